"""Per-request overhead of the engine against the bare diffusers pipeline, measured side by side.

The same requests (prompt, seed, size, steps) run through a bare ``StableDiffusionPipeline.__call__`` and
through ``DiffusionEngine`` (uni executor, request mode), interleaved in one process, alternating which
goes first. Prints medians, the overhead in ms and as a ratio, and what it ran on.

    .venv/bin/python bench/engine_overhead.py [--requests 40] [--steps 10] [--size 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", help="a diffusers SD folder (default: build the tiny one)")
    args = ap.parse_args()

    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model

    torch.set_num_threads(args.threads)
    model = args.model or str(make_tiny_model(tempfile.mkdtemp() + "/tiny-sd", kind="sd"))
    bare = DiffusionPipeline.from_pretrained(model, local_files_only=True, low_cpu_mem_usage=False)
    bare.set_progress_bar_config(disable=True)
    engine = DiffusionEngine.make_engine(load_config({"model": {"path": model}, "device": "cpu"}))

    def run_bare(prompt: str, seed: int) -> np.ndarray:
        images = bare(prompt=[prompt], negative_prompt=[""], height=args.size, width=args.size,
                      num_inference_steps=args.steps, guidance_scale=7.5,
                      generator=[torch.Generator("cpu").manual_seed(seed)], output_type="np").images
        return (images * 255).round().clip(0, 255).astype(np.uint8)

    def run_bare_inference_mode(prompt: str, seed: int) -> np.ndarray:
        with torch.inference_mode():          # what the runner wraps the call in: isolates engine overhead
            return run_bare(prompt, seed)

    def run_engine(prompt: str, seed: int) -> np.ndarray:
        return engine.generate(prompt, seed=seed, num_inference_steps=args.steps, height=args.size,
                               width=args.size, guidance_scale=7.5).images

    paths = {"bare": run_bare, "bare_inference_mode": run_bare_inference_mode, "engine": run_engine}
    for i in range(3):                                   # warm every path
        for fn in paths.values():
            fn("warm", i)
    times: dict[str, list[float]] = {name: [] for name in paths}
    max_diff = 0
    for i in range(args.requests):
        prompt, seed = f"a photo of object {i}", 1000 + i
        order = list(paths.items())
        results = {}
        for name, fn in order[i % 3:] + order[:i % 3]:   # rotate which path goes first
            t0 = time.perf_counter()
            results[name] = fn(prompt, seed)
            times[name].append(time.perf_counter() - t0)
        max_diff = max(max_diff, int(np.abs(results["bare"].astype(int) - results["engine"].astype(int)).max()))
    engine.close()

    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    mb, mi, me = med["bare"], med["bare_inference_mode"], med["engine"]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"ran on: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({args.threads} thread), "
          f"python {platform.python_version()}")
    print(f"workload: tiny SD {args.size}x{args.size}, {args.steps} steps, guidance 7.5, "
          f"{args.requests} requests each path, interleaved")
    print(f"median per request: bare diffusers {mb:.2f} ms | bare under inference_mode {mi:.2f} ms | "
          f"engine {me:.2f} ms")
    print(f"engine vs bare:                {me - mb:+.2f} ms  ratio {me / mb:.4f} ({(me / mb - 1) * 100:+.2f} %)")
    print(f"engine vs bare inference_mode: {me - mi:+.2f} ms  ratio {me / mi:.4f} ({(me / mi - 1) * 100:+.2f} %)"
          "  <- engine overhead proper")
    print(f"images identical to bare: max |diff| = {max_diff} (uint8)")


if __name__ == "__main__":
    main()
