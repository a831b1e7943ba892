"""The VAE decode's memory bound (``limits.decode_tile_side``): a video decoded in spatial tiles equals the untiled
decode within the stated tolerance (PSNR, mean |diff|), and its peak memory falls (peak RSS, a fresh process each)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from engine_probes import max_diff
from family_checks import Family, make_engine

from stage_runtime.config import ModelConfig, load_config
from stage_runtime.errors import ConfigError
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.videoio import psnr

torch.set_num_threads(1)
# Tiled vs whole frames on the tiny Wan at 128x128x5, tiles of 64 (measured: max 16 uint8 at a seam, mean 1.37,
# PSNR 42.1 dB; tiles of 96: 12, 0.78, 45.8 dB): the stated tolerance is PSNR >= 38 dB and a mean under 2.
TILE_PSNR_DB, TILE_MEAN = 38.0, 2.0
WAN = Family("wan", size=128, frames=5)

PEAK = """
import json, sys, torch
torch.set_num_threads(1)
sys.path[:0] = {paths!r}
from family_checks import Family, make_engine

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

engine = make_engine({path!r}, "request", warmup=False, limits={limits!r})
open("/proc/self/clear_refs", "w").write("5")          # the peak RSS starts again from the current RSS
before = status("VmRSS")
engine.add_request(Family("wan", size=256, frames=5).request("r", "a fox", 1, 1)).result(timeout=300)
print(json.dumps({{"peak_kb": status("VmHWM"), "before_kb": before}}))
engine.close()
"""


def video(path: str, limits: dict) -> np.ndarray:
    engine = make_engine(path, "request", warmup=False, **{"limits": limits} if limits else {})
    try:
        return engine.add_request(WAN.request("r", "a fox", 2, 4)).result(timeout=120).images
    finally:
        engine.close()


def test_a_tiled_decode_equals_the_whole_frame_decode_within_the_tolerance(tiny_wan_path):
    whole, tiled = video(tiny_wan_path, {}), video(tiny_wan_path, {"decode_tile_side": 64})
    assert tiled.shape == whole.shape == (1, 5, 128, 128, 3)
    assert max_diff(tiled, whole) > 0                               # tiled for real
    assert psnr(tiled[0], whole[0]) >= TILE_PSNR_DB and np.abs(tiled.astype(int) - whole.astype(int)).mean() < TILE_MEAN


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and resets its peak RSS")
def test_the_bound_lowers_the_decode_peak_memory(tiny_wan_path):
    """The peak RSS over the loaded engine while one 256x256x5 video is made (its decode dominates), measured from
    a reset high-water mark (/proc/self/clear_refs), so the engine's own loading does not hide it."""
    def peak(limits: dict) -> int:
        code = PEAK.format(paths=sys.path, path=tiny_wan_path, limits=limits)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        return measured["peak_kb"] - measured["before_kb"]

    whole, tiled = peak({}), peak({"decode_tile_side": 64})
    assert tiled < whole * 0.8, (whole, tiled)


def test_a_tile_smaller_than_the_decoder_takes_is_refused_at_load_naming_the_smallest(tiny_ltx2_path):
    # LTX-2's VAE makes 32 pixels of a latent a side: a tile of 64 (2 latents) failed in the decoder's padding
    # after a full denoise (found by bench/video_decode.py); now the stage does not start with it.
    adapter = resolve_adapter_class(ModelConfig(path=tiny_ltx2_path)).load(tiny_ltx2_path, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^limits\.decode_tile_side=64: LTX2Pipeline's VAE makes 32 pixels of a "
                                          r"latent a side; a tile takes at least 4 latents: 128 or more$"):
        adapter.bound_decode(64)
    adapter.bound_decode(128)
    assert adapter.pipe.vae.use_tiling


def test_a_vae_without_a_sized_tiling_is_refused_naming_the_setting(tiny_sd_path):
    adapter = resolve_adapter_class(ModelConfig(path=tiny_sd_path)).load(tiny_sd_path, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^limits\.decode_tile_side=64: StableDiffusionPipeline's VAE "
                                          r"\(AutoencoderKL\) has no tiled decode with a tile size$"):
        adapter.bound_decode(64)
    assert load_config({"model": {"path": "/m"}, "limits": {"decode_tile_side": 64}}).limits.decode_tile_side == 64
