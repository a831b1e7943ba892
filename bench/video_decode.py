"""The video VAE decode, bounded (``limits.decode_tile_side``) vs unbounded: its time, its peak memory, and how far
the bounded frames are from the unbounded ones.

Per video family (its tiny model, random weights), each measurement runs in a fresh process (so one run's
allocator state never hides the next one's peak): a request-mode engine makes one ``--size``² × ``--frames``
video in one step, streamed, and the decode is timed from the ``decode`` phase item to the final item (the
engine's own progress phases). The peak RSS is the process's high-water mark from a reset
(``/proc/self/clear_refs``) just before the request, less the RSS then. The runs alternate unbounded and
bounded. Prints the medians with min–max and the number of runs, the bounded/unbounded ratios, PSNR and
max |diff| of the bounded frames against the unbounded, and what it ran on.

    .venv/bin/python bench/video_decode.py [--runs 3] [--size 256] [--frames 9] [--tile N] [--kind wan]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stats import machine, ratio_summary, spread  # noqa: E402

KINDS = ("wan", "hunyuan-video15", "ltx2")
# The tile side per kind (--tile overrides): at least 4 latents a side (LTX-2's VAE makes 32 pixels of one);
# HunyuanVideo-1.5's tiles of 64 blend to 31 dB of the whole-frame decode (measured), of 128 closer.
TILES = {"wan": 64, "hunyuan-video15": 128, "ltx2": 128}


def status_kb(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key + ":"))


def child(path: str, size: int, frames: int, tile: int, out: str) -> None:
    """One measurement in this process: prints {decode_s, peak_kb}; saves the frames to ``out`` (.npy)."""
    import time

    import numpy as np
    import torch

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.request import DiffusionRequest, SamplingParams

    torch.set_num_threads(1)
    limits = {"decode_tile_side": tile} if tile else {}
    engine = DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "executor": "uni", "warmup": False, "limits": limits,
        "scheduler": {"execution_mode": "request"}}))
    try:
        sampling = SamplingParams(seed=3, num_inference_steps=1, height=size, width=size, num_frames=frames,
                                  guidance_scale=1.0, stream=True)
        with open("/proc/self/clear_refs", "w") as reset:
            reset.write("5")                                   # the peak RSS starts again from the current RSS
        before = status_kb("VmRSS")
        decode_at = final = None
        for item in engine.add_request(DiffusionRequest("r", "a fox", sampling, video=True)):
            if item.phase == "decode":
                decode_at = time.perf_counter()
            if item.finished:
                final = item
        decoded = time.perf_counter()
        assert final is not None and final.ok and decode_at is not None, final
        np.save(out, final.images[0])
        print(json.dumps({"decode_s": decoded - decode_at, "peak_kb": status_kb("VmHWM") - before}))
    finally:
        engine.close()


def measure(path: str, args, tile: int, out: str) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path, "--size", str(args.size),
                           "--frames", str(args.frames), "--tile", str(tile), "--out", out],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"measurement failed ({path}, tile {tile}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_kind(kind: str, args, root: str) -> None:
    import numpy as np

    from stage_runtime.models.tiny import make_tiny_model
    from stage_runtime.videoio import psnr

    path = str(make_tiny_model(f"{root}/{kind}", kind=kind))
    side = args.tile or TILES[kind]
    runs: dict[int, list[dict]] = {0: [], side: []}
    for i in range(args.runs):
        for tile in ((0, side) if i % 2 == 0 else (side, 0)):
            runs[tile].append(measure(path, args, tile, f"{root}/{kind}-{tile}.npy"))
    whole, tiled = np.load(f"{root}/{kind}-0.npy"), np.load(f"{root}/{kind}-{side}.npy")
    diff = np.abs(whole.astype(int) - tiled.astype(int))
    print(f"\n== {kind}: decode of {args.size}x{args.size}x{args.frames}, {args.runs} runs each, alternating ==")
    for tile, label in ((0, "unbounded"), (side, f"tiles of {side}")):
        seconds = [r["decode_s"] for r in runs[tile]]
        peaks = [r["peak_kb"] / 1024 for r in runs[tile]]
        print(f"  {label:14s} decode {spread(seconds)}   peak RSS over the loaded engine {spread(peaks, ' MiB', 1.0)}")
    def of(tile: int, key: str) -> list[float]:
        return [r[key] for r in runs[tile]]

    print(f"  {'bounded / unbounded':20s} decode {ratio_summary(of(side, 'decode_s'), of(0, 'decode_s'))}"
          f"   peak {ratio_summary(of(side, 'peak_kb'), of(0, 'peak_kb'))}")
    print(f"  bounded vs unbounded frames: PSNR {psnr(tiled, whole):.1f} dB, mean |diff| {diff.mean():.2f}, "
          f"max |diff| {diff.max()} (uint8)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--tile", type=int, default=0, help="the tile side (default: per kind, TILES)")
    ap.add_argument("--kind", action="append", choices=KINDS, help="default: every kind")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.size, args.frames, args.tile, args.out)
        return
    if not sys.platform.startswith("linux"):
        print("SKIP: the peak memory is read from /proc (Linux only)")
        return
    import torch

    with tempfile.TemporaryDirectory() as root:
        for kind in args.kind or KINDS:
            bench_kind(kind, args, root)
    print(f"\nran on: {machine()}; torch {torch.__version__} (1 thread)")


if __name__ == "__main__":
    main()
