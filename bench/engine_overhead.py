"""Per-request overhead of the engine against the bare diffusers pipeline, measured side by side.

The same requests (prompt, seed, size, steps) run through a bare ``StableDiffusionPipeline.__call__``
(plain, and under ``torch.inference_mode`` as the runner calls it), through the bare call on the engine's
own pipeline object (the same weights in memory: two separately loaded copies differ by their memory
placement, which is not engine overhead) and through ``DiffusionEngine`` (uni executor, request mode),
interleaved in one process, rotating which path goes first; and that bare call on a thread of its own
(``bare_on_a_thread``: what running off the main thread alone costs). For the engine the time is split
into the pipeline call on the engine thread (``compute_ms``, measured by the runner), everything else
(admission, the thread hand-off, scheduling, delivery), and the engine's per-step hook inside the call
(timed around the runner's progress hook). Those two are the engine's own work, timed directly: on a
machine whose speed drifts by tens of percent between consecutive calls they are the precise number,
and the per-pair ratios (printed with their spread) bound the rest. Prints medians, min–max spreads,
per-pair ratios and the number of runs, and what it ran on.

    .venv/bin/python bench/engine_overhead.py [--requests 40] [--steps 10] [--size 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stats import machine, ratio_summary, spread  # noqa: E402


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
    runner = engine.executor.worker.model_runner
    served = runner.adapter.pipe                                 # the engine's own pipeline object
    compute: list[float] = []
    hook_s = [0.0]                                               # time inside the engine's step hook
    inner_hook = runner.progress_hook

    def timed_hook(event):
        t = time.perf_counter()
        try:
            return inner_hook(event)
        finally:
            hook_s[0] += time.perf_counter() - t

    runner.progress_hook = timed_hook
    hooks: list[float] = []
    pool = ThreadPoolExecutor(1, thread_name_prefix="bare")
    assert pool.submit(threading.current_thread).result() is not threading.main_thread()

    def run_bare(prompt: str, seed: int, pipe=bare) -> np.ndarray:
        images = pipe(prompt=[prompt], negative_prompt=[""], height=args.size, width=args.size,
                      num_inference_steps=args.steps, guidance_scale=7.5,
                      generator=[torch.Generator("cpu").manual_seed(seed)], output_type="np").images
        return (images * 255).round().clip(0, 255).astype(np.uint8)

    def run_bare_inference_mode(prompt: str, seed: int) -> np.ndarray:
        with torch.inference_mode():          # what the runner wraps the call in: isolates engine overhead
            return run_bare(prompt, seed)

    def run_bare_same_weights(prompt: str, seed: int) -> np.ndarray:
        with torch.inference_mode():
            return run_bare(prompt, seed, pipe=served)

    def run_bare_on_a_thread(prompt: str, seed: int) -> np.ndarray:
        return pool.submit(run_bare_same_weights, prompt, seed).result()

    def run_engine(prompt: str, seed: int) -> np.ndarray:
        hook_s[0] = 0.0
        out = engine.generate(prompt, seed=seed, num_inference_steps=args.steps, height=args.size,
                              width=args.size, guidance_scale=7.5)
        compute.append(out.metrics["compute_ms"] / 1e3)
        hooks.append(hook_s[0])
        return out.images

    paths = {"bare": run_bare, "bare_inference_mode": run_bare_inference_mode,
             "bare_same_weights": run_bare_same_weights, "bare_on_a_thread": run_bare_on_a_thread,
             "engine": run_engine}
    for i in range(3):                                   # warm every path
        for fn in paths.values():
            fn("warm", i)
    compute.clear()
    hooks.clear()
    times: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}   # process CPU time: robust to a busy machine
    max_diff = 0
    for i in range(args.requests):
        prompt, seed = f"a photo of object {i}", 1000 + i
        order = list(paths.items())
        results = {}
        for name, fn in order[i % len(order):] + order[:i % len(order)]:   # rotate which path goes first
            t0, c0 = time.perf_counter(), time.process_time()
            results[name] = fn(prompt, seed)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        max_diff = max(max_diff, int(np.abs(results["bare"].astype(int) - results["engine"].astype(int)).max()))
    engine.close()
    pool.shutdown()

    eng, im, same = times["engine"], times["bare_inference_mode"], times["bare_same_weights"]
    outside = [e - c for e, c in zip(eng, compute, strict=True)]
    deltas = [e - b for e, b in zip(eng, same, strict=True)]
    print(f"ran on: {machine()}; torch {torch.__version__} ({args.threads} thread)")
    print(f"workload: tiny SD {args.size}x{args.size}, {args.steps} steps, guidance 7.5, {args.requests} requests "
          f"per path, interleaved (order rotated), after 3 warm-up requests per path")
    for name, values in times.items():
        print(f"  {name:20s} {spread(values)}")
    print(f"engine vs bare:                {ratio_summary(eng, times['bare'])}")
    print(f"engine vs bare inference_mode: {ratio_summary(eng, im)}  (another copy of the weights)")
    print(f"same weights, two copies:      {ratio_summary(same, im)}  <- memory placement alone")
    print(f"engine vs bare, same weights:  {ratio_summary(eng, same)}  <- engine overhead proper")
    print(f"  per-pair difference: {spread(deltas)}  ({(statistics.median(eng) / statistics.median(same) - 1) * 100:+.2f} % "
          f"of the medians)")
    print(f"  split: pipeline call on the engine thread {spread(compute)}; "
          f"outside the call (admission, hand-off, scheduling, delivery) {spread(outside)}")
    print(f"  pipeline call on the engine thread vs bare, same weights: {ratio_summary(compute, same)}")
    print(f"  bare on a thread of its own vs bare, same weights: {ratio_summary(times['bare_on_a_thread'], same)}"
          "  <- off the main thread alone")
    own = [o + h for o, h in zip(outside, hooks, strict=True)]
    print(f"engine's own work per request, timed directly: outside the call {spread(outside)} + step hooks inside "
          f"it {spread(hooks)} = {spread(own)}; {statistics.median(own) / statistics.median(same) * 100:.2f} % of the "
          f"bare call's median")
    print("process CPU time per request (all threads; less sensitive to other load than wall time):")
    for name, values in cpu.items():
        print(f"  {name:20s} {spread(values)}")
    print(f"  engine vs bare, same weights: {ratio_summary(cpu['engine'], cpu['bare_same_weights'])}")
    print(f"images identical to bare: max |diff| = {max_diff} (uint8)")


if __name__ == "__main__":
    main()
