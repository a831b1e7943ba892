"""MP4 encode cost of the video output (stage_runtime/videoio.py: PyAV's libx264, yuv420p, crf 18): the x264
presets ``veryfast`` (the default) and ``ultrafast`` side by side, on an 81×480×832 clip (Wan's default
length at 480p) and a 17×32×32 one (the tiny models' size). Runs alternate between the presets; each line
gives the encode time (median, min–max over the runs), the MP4's size and its PSNR against the frames.

The clip is random but smooth: random colours bicubic-upscaled ×16 (blobs ~16 px across) under a slow
brightness ramp, the camera panning 2 px a frame (tiny clip: ×8 and 1 px), as generated video moves.

    .venv/bin/python bench/video_encode.py [--runs 3] [--crf 18]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'bench'))

from stage_runtime.videoio import decode_mp4, encode_mp4, psnr  # noqa: E402
from stats import machine, spread  # noqa: E402

PRESETS = ('veryfast', 'ultrafast')
CLIPS = ((81, 480, 832, 16, 2), (17, 32, 32, 8, 1))     # frames, height, width, blob size, pan px per frame


def panning_clip(frames: int, height: int, width: int, blob: int, pan: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    wide = width + pan * (frames - 1)
    small = rng.integers(0, 256, (height // blob + 1, wide // blob + 1, 3), dtype=np.uint8)
    texture = np.asarray(Image.fromarray(small).resize((small.shape[1] * blob, small.shape[0] * blob),
                                                       Image.BICUBIC), dtype=np.float32)[:height, :wide]
    ramp = np.linspace(0.85, 1.0, frames, dtype=np.float32)
    return np.stack([np.clip(texture[:, i * pan:i * pan + width] * ramp[i], 0, 255).astype(np.uint8)
                     for i in range(frames)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=3)
    parser.add_argument('--crf', type=int, default=18)
    args = parser.parse_args()
    print(f'machine: {machine()}')
    for frames, height, width, blob, pan in CLIPS:
        clip = panning_clip(frames, height, width, blob, pan)
        encode_mp4(clip[:2], 16, crf=args.crf)                      # first-use costs (codec lookup) out of the runs
        seconds: dict[str, list[float]] = {preset: [] for preset in PRESETS}
        data: dict[str, bytes] = {}
        for run in range(args.runs):
            for preset in PRESETS[run % 2:] + PRESETS[:run % 2]:     # the order alternates
                started = time.perf_counter()
                data[preset] = encode_mp4(clip, 16, crf=args.crf, preset=preset)
                seconds[preset].append(time.perf_counter() - started)
        print(f'{frames}x{height}x{width} (frames x height x width, {clip.nbytes / 1e6:.1f} MB of RGB), crf '
              f'{args.crf}, {args.runs} runs each:')
        for preset in PRESETS:
            quality = psnr(clip, decode_mp4(data[preset])[0])
            print(f'  {preset:>9}: encode {spread(seconds[preset], unit="s", scale=1, digits=3)}, '
                  f'{len(data[preset]) / 1e6:.3f} MB out, PSNR {quality:.2f} dB')


if __name__ == '__main__':
    main()
