"""Per video family: engine vs bare diffusers, batch-of-2 vs sequential, and short requests among long videos.

For every tiny video kind one process measures, interleaved with the order rotated every run:

    bare          the pipeline's own ``__call__`` for one video (per-video generator, seed)
    engine req    DiffusionEngine (uni executor), request mode, one video
    engine step   DiffusionEngine, step mode, one video
    seq x2        two videos one after another through the bare pipeline
    batch x2      the same two videos submitted at once to a step-mode engine with max_num_seqs=2 (one
                  denoiser forward per step for both: the frames' rows fused)

Then the mixed load (``--mixed``): two long videos (``--long-steps``) start, and short requests (one frame, 3
steps) arrive one after another while they run. Served by a step-mode engine with the priority policy (a short
request preempts at the next step boundary) and by a plain server: request mode, FIFO, one request at a time
(what a one-lock server does). It prints the short requests' p50 / p99 latency and the makespan of each.

Every path prints the median and min–max, each pair the median ratio and its min–max, with the number of runs and
what it ran on; the largest |diff| against the bare call (uint8, every frame) is printed too.

    .venv/bin/python bench/video_families.py [--runs 5] [--steps 6] [--size 32] [--frames 17] [--kind wan]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stats import machine, max_uint8_diff, ratio_summary, rotated_round, spread  # noqa: E402

KINDS = ("wan", "wan22", "wan-ti2v", "wan-i2v", "hunyuan-video15", "ltx2")
# Each kind's smallest served shape, where it differs from --size / --frames: TI2V-5B's patching needs 32 a
# side; LTX-2 takes 8k+1 frames and 64 a side at least (its VAE makes 32 pixels of a latent).
SHAPES = {"wan-ti2v": (32, None), "ltx2": (64, 9)}


def reference_image(size: int):
    import numpy as np

    ramp = np.linspace(0, 255, size, dtype=np.float32)
    return np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, 255 - ramp) / 2,
                     np.full((size, size), 96.0)], axis=-1).round().astype(np.uint8)


def make_engine(path: str, mode: str, seqs: int, **scheduler):
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine

    return DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "executor": "uni", "warmup": False,
        "scheduler": {"execution_mode": mode, "max_num_seqs": seqs, "request_batch_max_wait_ms": 200.0,
                      **scheduler}}))


def video_request(rid: str, prompt: str, seed: int, steps: int, size: int, frames: int, reference, **kw):
    from stage_runtime.request import DiffusionRequest, SamplingParams

    return DiffusionRequest(rid, prompt, SamplingParams(seed=seed, num_inference_steps=steps, height=size, width=size,
                                                        num_frames=frames, guidance_scale=5.0, **kw),
                            video=True, reference=reference)


def bench_kind(kind: str, args, root: str) -> None:
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    from stage_runtime.models.tiny import make_tiny_model

    path = str(make_tiny_model(f"{root}/{kind}", kind=kind))
    size, frames = SHAPES.get(kind, (None, None))
    size, frames = size or args.size, frames or args.frames
    reference = reference_image(size) if kind == "wan-i2v" else None
    image = {} if reference is None else {"image": Image.fromarray(reference)}
    bare = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    bare.set_progress_bar_config(disable=True)
    guidance = {"guidance_scale": 5.0}
    if kind == "hunyuan-video15":          # the scale is its guider component's; its VAE decodes one video a call
        bare.guider, guidance = bare.guider.new(guidance_scale=5.0), {}
        bare.vae.enable_slicing()
    engines = {"req": make_engine(path, "request", 1), "step": make_engine(path, "step", 1),
               "batch": make_engine(path, "step", 2)}

    def run_bare(prompt, seed):
        with torch.inference_mode():
            video = bare(prompt=[prompt], height=size, width=size, num_frames=frames, num_inference_steps=args.steps,
                         generator=[torch.Generator().manual_seed(seed)], output_type="np", **guidance, **image).frames
        return (np.asarray(video) * 255).round().clip(0, 255).astype(np.uint8)

    def run_engine(key):
        return lambda prompt, seed: engines[key].add_request(video_request(
            f"{key}{seed}", prompt, seed, args.steps, size, frames, reference)).result(timeout=600).images

    def run_seq2(prompt, seed):
        return [run_bare(f"{prompt} {j}", seed + j) for j in range(2)]

    def run_batch2(prompt, seed):
        streams = [engines["batch"].add_request(video_request(f"b{seed}-{j}", f"{prompt} {j}", seed + j, args.steps,
                                                              size, frames, reference)) for j in range(2)]
        return [s.result(timeout=600).images for s in streams]

    paths = {"bare": run_bare, "engine req": run_engine("req"), "engine step": run_engine("step"),
             "seq x2": run_seq2, "batch x2": run_batch2}
    for fn in paths.values():
        fn("warm", 0)
    times: dict[str, list[float]] = {k: [] for k in paths}
    diff = 0
    for i in range(args.runs):
        results = rotated_round(paths, i, times, f"a clip of object {i}", 1000 + 10 * i)
        pairs = [("engine req", "bare"), ("engine step", "bare"), ("batch x2", "seq x2")]
        diff = max_uint8_diff(results, pairs, diff)
    for engine in engines.values():
        engine.close()
    print(f"\n== {kind} ({type(bare).__name__}), {size}x{size}x{frames}, {args.steps} steps, "
          f"{args.runs} runs per path, interleaved ==")
    for key, values in times.items():
        print(f"  {key:12s} {spread(values)}")
    for key in ("engine req", "engine step"):
        print(f"  {key + ' / bare':20s} {ratio_summary(times[key], times['bare'])}")
    print(f"  {'seq x2 / batch x2':20s} {ratio_summary(times['seq x2'], times['batch x2'])}  (> 1: batching wins)")
    print(f"  frames vs bare: max |diff| = {diff} (uint8)")
    if args.mixed:
        bench_mixed(path, args, size, frames, reference)


def bench_mixed(path: str, args, size: int, frames: int, reference) -> None:
    """Short one-frame requests arriving while two long videos run: priority step mode vs a FIFO one-at-a-time
    server. Per run: each short request's latency from its arrival, and the makespan."""
    import numpy as np

    servers = {"priority step": ("step", 2, {"scheduling_policy": "priority", "max_preemptions": 100}),
               "fifo one-lock": ("request", 1, {})}
    for name, (mode, seqs, scheduler) in servers.items():
        engine = make_engine(path, mode, seqs, **scheduler)
        latencies, makespans = [], []
        for run in range(args.runs):
            t0 = time.perf_counter()
            longs = [engine.add_request(video_request(f"L{run}-{j}", "a long clip", run * 10 + j, args.long_steps,
                                                      size, frames, reference)) for j in range(2)]
            for k in range(args.shorts):
                arrival = time.perf_counter()
                engine.add_request(video_request(f"S{run}-{k}", "a still", 500 + k, 3, size, 1, reference,
                                                 priority=10)).result(timeout=600)
                latencies.append(time.perf_counter() - arrival)
            for stream in longs:
                stream.result(timeout=600)
            makespans.append(time.perf_counter() - t0)
        engine.close()
        lat = np.asarray(latencies) * 1e3
        print(f"  mixed, {name:14s} short p50 {np.percentile(lat, 50):.0f} ms, p99 {np.percentile(lat, 99):.0f} ms "
              f"({len(lat)} shorts); makespan {spread(makespans, 's', 1.0)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mixed", action="store_true", help="also the mixed load (short requests among long videos)")
    ap.add_argument("--long-steps", type=int, default=30)
    ap.add_argument("--shorts", type=int, default=5)
    ap.add_argument("--kind", action="append", choices=KINDS, help="default: every kind")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        for kind in args.kind or KINDS:
            bench_kind(kind, args, root)
    print(f"\nran on: {machine()}; torch {torch.__version__} ({args.threads} thread)")


if __name__ == "__main__":
    main()
