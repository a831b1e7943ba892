"""Per model family: engine overhead against the bare diffusers pipeline (request and step mode) and
request-batch-4 throughput against 4 sequential bare calls, measured side by side in one run.

For each family in FAMILIES (its tiny build): one bare pipeline and two engines (uni executor; request mode
with max_num_seqs=4, step mode with max_num_seqs=4) in one process. Each round runs, in a rotating order,
one request on every path, then 4 requests as 4 sequential bare calls and as one burst into a request-mode
engine with a 50 ms batch wait (fused into one pipeline call). Prints medians with min–max over the rounds,
per-pair ratios (each round's paths back to back, so slow drifts of a busy machine cancel), the number of
rounds, and the largest uint8 difference between the engine's images and the bare call's.

    .venv/bin/python bench/model_families.py [--families sd3,flux] [--rounds 10] [--steps 8] [--size 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stats import machine, ratio_summary, spread  # noqa: E402


@dataclass(frozen=True)
class Family:
    kind: str                       # make-tiny-model --kind
    guidance: float                 # guidance_scale for every path
    bare_kwargs: dict = field(default_factory=dict)    # extra keywords of the bare __call__ (same as the adapter's)


FAMILIES: dict[str, Family] = {
    "sd3": Family("sd3", 7.0, {"negative_prompt": None}),
    "flux": Family("flux", 3.5),
}


def bench_family(name: str, family: Family, args) -> None:
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model
    from stage_runtime.request import DiffusionRequest, SamplingParams

    model = str(make_tiny_model(tempfile.mkdtemp() + f"/tiny-{family.kind}", kind=family.kind))
    bare = DiffusionPipeline.from_pretrained(model, local_files_only=True, low_cpu_mem_usage=False)
    bare.set_progress_bar_config(disable=True)

    def engine(mode: str, wait_ms: float = 0.0) -> DiffusionEngine:
        return DiffusionEngine.make_engine(load_config({"model": {"path": model}, "device": "cpu", "scheduler": {
            "execution_mode": mode, "max_num_seqs": 4, "request_batch_max_wait_ms": wait_ms}}))

    # one request: no batch wait; a burst of 4: a short wait so all 4 join one fused call
    engines = {"request": engine("request"), "step": engine("step"), "batch": engine("request", 50.0)}
    sampling = {"num_inference_steps": args.steps, "height": args.size, "width": args.size,
                "guidance_scale": family.guidance}

    def run_bare(prompts: list[str], seeds: list[int]) -> list[np.ndarray]:
        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):      # sequential calls, one image each
            with torch.inference_mode():
                images = bare(prompt=[prompt], height=args.size, width=args.size, num_inference_steps=args.steps,
                              guidance_scale=family.guidance, generator=[torch.Generator("cpu").manual_seed(seed)],
                              output_type="np", **family.bare_kwargs).images
            out.append((images * 255).round().clip(0, 255).astype(np.uint8))
        return out

    def run_engine(mode: str, prompts: list[str], seeds: list[int]) -> list[np.ndarray]:
        eng = engines[mode]
        streams = [eng.add_request(DiffusionRequest(f"{mode}-{seed}", prompt, SamplingParams(seed=seed, **sampling)))
                   for prompt, seed in zip(prompts, seeds, strict=True)]
        return [s.result(timeout=300).images for s in streams]

    paths = {"bare": run_bare, "engine-request": lambda p, s: run_engine("request", p, s),
             "engine-step": lambda p, s: run_engine("step", p, s)}
    for i in range(2):                                               # warm every path
        for fn in paths.values():
            fn([f"warm {i}"], [i])
        run_engine("batch", [f"warm {i}"] * 4, [10 + i * 4 + k for k in range(4)])
    single: dict[str, list[float]] = {k: [] for k in paths}
    burst: dict[str, list[float]] = {"bare x4 sequential": [], "engine-request batch of 4": []}
    max_diff = 0
    for r in range(args.rounds):
        prompt, seed = f"a photo of object {r}", 1000 + r
        order = list(paths.items())
        results = {}
        for label, fn in order[r % 3:] + order[:r % 3]:              # rotate which path goes first
            t0 = time.perf_counter()
            results[label] = fn([prompt], [seed])[0]
            single[label].append(time.perf_counter() - t0)
        for label in ("engine-request", "engine-step"):
            max_diff = max(max_diff, int(np.abs(results[label].astype(int) - results["bare"].astype(int)).max()))
        prompts, seeds = [f"a red car {r}.{k}" for k in range(4)], [2000 + 4 * r + k for k in range(4)]
        bursts = [("bare x4 sequential", run_bare), ("engine-request batch of 4",
                                                     lambda p, s: run_engine("batch", p, s))]
        for label, fn in (bursts if r % 2 == 0 else bursts[::-1]):
            t0 = time.perf_counter()
            fn(prompts, seeds)
            burst[label].append(time.perf_counter() - t0)
    for eng in engines.values():
        eng.close()

    print(f"\n[{name}] tiny {family.kind} {args.size}x{args.size}, {args.steps} steps, guidance {family.guidance:g}, "
          f"{args.rounds} rounds interleaved (order rotated), after 2 warm-up rounds")
    for label, values in single.items():
        print(f"  one request   {label:<28}{spread(values)}")
    for label, values in burst.items():
        print(f"  four requests {label:<28}{spread(values)}")
    print(f"  engine request mode vs bare: {ratio_summary(single['engine-request'], single['bare'])}")
    print(f"  engine step mode vs bare:    {ratio_summary(single['engine-step'], single['bare'])}")
    print(f"  4 sequential bare calls vs one request-mode batch of 4 (throughput gain): "
          f"{ratio_summary(burst['bare x4 sequential'], burst['engine-request batch of 4'])}")
    print(f"  images vs bare call: max |diff| = {max_diff} (uint8)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"--families: unknown family {unknown[0]!r} (known: {', '.join(FAMILIES)})")

    import torch

    torch.set_num_threads(args.threads)
    for name in names:
        bench_family(name, FAMILIES[name], args)
    print(f"\nran on: {machine()}; torch {torch.__version__} ({args.threads} thread)")


if __name__ == "__main__":
    main()
