"""Cache acceleration: block cache latency vs quality per threshold, the fused-tick row split, exact hits.

For tiny DiT and tiny FLUX (the tiny builders' layout with ``--layers`` blocks: the shipped tiny models have
2, where a skip can save one block at most) one engine per model serves, interleaved and with the order
rotated every run, the same request (seed, 20 steps):

    uncached          ``cache: "off"``
    t=<threshold>     ``cache: {"threshold": t}`` (warmup 1 and final 1 forced steps)

and prints per threshold the per-pair latency ratio cached / uncached (median, min–max, runs) — wall time
and the process's CPU time, which other work on a shared machine disturbs less — the skip
ratio the engine reports (steps_skipped / steps), and the deviation from the uncached image (max and mean
|diff| in uint8, PSNR in dB). With random weights no image metric says anything about a real model's
quality; the deviation shows the shape of the trade-off.

The trained tiny digits DiT (``tiny-digits`` as shipped, its own blocks: bench/digit_quality.py) then draws every digit
"0".."9" (``--per-digit`` images each) uncached and at each threshold: besides latency, skip ratio and PSNR,
the digit judge's score (the share of images read as the digit asked for) against the uncached score; a
threshold whose score drops more than 5 points is flagged.

Then, in step mode, one tick of 4 requests where 2 skip the rest of the blocks (the runner gathers the
computing rows and runs blocks 1..N-1 on them only) against 4 that all compute and against the 2
computing requests alone; and the exact-hit result cache: a repeat's time over the first request's.

    .venv/bin/python bench/cache.py [--runs 3] [--steps 20] [--layers 12] [--threads 1] [--per-digit 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digit_quality import digits_folder, draw_digits, images, quality  # noqa: E402
from stats import machine, ratio_summary, spread  # noqa: E402

THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.4, 10.0)
CPU_SECONDS: list[float] = []        # the process's CPU time of each timed request (the engine runs in it: uni)


def deep_model(root: str, kind: str, layers: int) -> str:
    """The tiny ``kind`` folder with a transformer of ``layers`` blocks (same config otherwise, seeded)."""
    import diffusers
    import torch

    from stage_runtime.models.tiny import make_tiny_model

    path = make_tiny_model(f"{root}/{kind}", kind=kind, seed=0)
    pipe = diffusers.DiffusionPipeline.from_pretrained(path, local_files_only=True)
    config = dict(pipe.transformer.config)
    if kind == "flux":
        config.update(num_layers=2, num_single_layers=max(1, layers - 2))
    else:
        config.update(num_layers=layers)
    torch.manual_seed(0)
    pipe.transformer = type(pipe.transformer).from_config(config)
    out = f"{root}/{kind}-{layers}"
    pipe.save_pretrained(out)
    return out


def engine(path: str, mode: str = "request", **cache):
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine

    return DiffusionEngine.make_engine(load_config({"model": {"path": path}, "device": "cpu", "cache": cache,
                                                    "scheduler": {"execution_mode": mode, "max_num_seqs": 4}}))


def timed(eng, rid: str, **sampling):
    from stage_runtime.request import DiffusionRequest, SamplingParams

    start, cpu = time.perf_counter(), time.process_time()
    out = eng.add_request(DiffusionRequest(rid, "a cat", SamplingParams(**sampling))).result(timeout=600)
    CPU_SECONDS.append(time.process_time() - cpu)
    return time.perf_counter() - start, out


def psnr(a, b) -> float:
    mse = float(((a.astype(float) - b.astype(float)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def block_cache_table(name: str, path: str, args, size: dict) -> None:
    eng = engine(path)
    paths = ["uncached", *THRESHOLDS]
    times: dict = {p: [] for p in paths}
    cpu: dict = {p: [] for p in paths}
    last: dict = {}
    seq = 0
    try:
        timed(eng, "warm", seed=0, num_inference_steps=args.steps, cache="off", **size)     # first-call costs
        timed(eng, "warm-cached", seed=0, num_inference_steps=args.steps, cache={"threshold": 10.0}, **size)
        for run in range(args.runs):
            for p in paths[run % len(paths):] + paths[:run % len(paths)]:
                cache = "off" if p == "uncached" else {"threshold": p}
                seq += 1
                seconds, out = timed(eng, f"r{seq}", seed=7, num_inference_steps=args.steps, cache=cache, **size)
                times[p].append(seconds)
                cpu[p].append(CPU_SECONDS[-1])
                last[p] = out
    finally:
        eng.close()
    base = last["uncached"].images
    print(f"\n== {name} ({path.rsplit('/', 1)[-1]}), {args.steps} steps, {args.runs} runs interleaved")
    print(f"  uncached        {spread(times['uncached'])}")
    for t in THRESHOLDS:
        out = last[t]
        diff = abs(out.images.astype(int) - base.astype(int))
        skip = out.metrics["steps_skipped"] / args.steps
        print(f"  t={t:<6g}  skip ratio {skip:.2f}  max|diff| {diff.max()}  mean|diff| {diff.mean():.2f}  "
              f"PSNR {psnr(out.images, base):.1f} dB\n"
              f"            latency   {ratio_summary(times[t], times['uncached'])}\n"
              f"            CPU time  {ratio_summary(cpu[t], cpu['uncached'])}")


def digits_table(path: str, args) -> None:
    """The trained digits DiT: every digit uncached and at each threshold, interleaved, the order rotated."""
    eng = engine(path)
    paths = ["uncached", *THRESHOLDS]
    times: dict = {p: [] for p in paths}
    last: dict = {}
    try:
        draw_digits(eng, "warm", 1, num_inference_steps=args.steps, cache="off")
        for run in range(args.runs):
            for p in paths[run % len(paths):] + paths[:run % len(paths)]:
                cache = "off" if p == "uncached" else {"threshold": p}
                start = time.perf_counter()
                last[p] = draw_digits(eng, f"r{run}-{p}", args.per_digit, num_inference_steps=args.steps,
                                      cache=cache)
                times[p].append(time.perf_counter() - start)
    finally:
        eng.close()
    base = images(last["uncached"])
    blocks = json.loads((Path(path) / "transformer" / "config.json").read_text())["num_layers"]
    print(f"\n== trained tiny digits DiT ({blocks} blocks), the 10 digits x {args.per_digit} images, "
          f"{args.steps} steps, {args.runs} runs interleaved")
    print(f"  uncached        {spread(times['uncached'])} for all 10 requests")
    for t in THRESHOLDS:
        outs = last[t].values()
        skip = sum(o.metrics["steps_skipped"] for o in outs) / (args.steps * len(outs))
        print(f"  t={t:<6g}  skip ratio {skip:.2f}  {quality(images(last[t]), base, 'uncached')}\n"
              f"            latency   {ratio_summary(times[t], times['uncached'])}")


def fused_tick(path: str, args, size: dict) -> None:
    """4 requests in one tick: all compute / 2 skip (row subset) / only the 2 that compute."""
    eng = engine(path, mode="step")
    from stage_runtime.request import DiffusionRequest, SamplingParams

    def batch(caches) -> float:
        start = time.perf_counter()
        streams = [eng.add_request(DiffusionRequest(f"t{time.monotonic_ns()}-{i}", "a cat", SamplingParams(
            seed=i, num_inference_steps=args.steps, cache=c, **size))) for i, c in enumerate(caches)]
        for s in streams:
            s.result(timeout=600)
        return time.perf_counter() - start

    plans = {"4 compute": ["off"] * 4, "2 compute + 2 skip": ["off", {"threshold": 10.0}] * 2,
             "2 compute alone": ["off"] * 2}
    times: dict = {p: [] for p in plans}
    try:
        batch(plans["4 compute"])
        batch(plans["2 compute + 2 skip"])
        names = list(plans)
        for run in range(args.runs):
            for p in names[run % 3:] + names[:run % 3]:
                times[p].append(batch(plans[p]))
    finally:
        eng.close()
    print("\n== fused step-mode tick, 4 requests (the skipping rows leave blocks 1..N-1 by index_select)")
    for p in plans:
        print(f"  {p:<20} {spread(times[p])}")
    print(f"  2 skip / 4 compute    {ratio_summary(times['2 compute + 2 skip'], times['4 compute'])}")
    print(f"  2 skip / 2 alone      {ratio_summary(times['2 compute + 2 skip'], times['2 compute alone'])}")


def exact_hit(path: str, args, size: dict) -> None:
    eng = engine(path, result_max_bytes=64 << 20)
    firsts, repeats, same = [], [], True
    try:
        for run in range(args.runs):
            first_s, first = timed(eng, f"f{run}", seed=100 + run, num_inference_steps=args.steps, **size)
            repeat_s, repeat = timed(eng, f"h{run}", seed=100 + run, num_inference_steps=args.steps, **size)
            firsts.append(first_s)
            repeats.append(repeat_s)
            same = same and bool((first.images == repeat.images).all())
    finally:
        eng.close()
    print("\n== exact-hit result cache (a repeat of the same request, explicit seed)")
    print(f"  first   {spread(firsts)}\n  repeat  {spread(repeats, digits=3)}")
    print(f"  repeat / first  {ratio_summary(repeats, firsts)}  identical images: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--per-digit", type=int, default=4, help="images of each digit in the digits table")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}; torch threads {args.threads}")
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as root:
        dit = deep_model(root, "dit", args.layers)
        flux = deep_model(root, "flux", args.layers)
        block_cache_table("tiny DiT", dit, args, {})
        block_cache_table("tiny FLUX.1", flux, args, {"height": 64, "width": 64})
        digits_table(digits_folder(root), args)
        fused_tick(dit, args, {})
        exact_hit(dit, args, {})
    print(f"\nmedians of {args.runs} runs; ratios are per pair (the two paths of one run, back to back)")


if __name__ == "__main__":
    main()
