"""FLUX.1's original (Black Forest Labs) GGUF layout at FLUX.1's own width, end to end (run by hand; ~25 s, ~4 GB).

diffusers 0.42.1 converts a FLUX.1 file in BFL's layout assuming FLUX.1's width (3072, MLP ratio 4), so the tiny
FLUX.1 (width 32) is tested with diffusers-layout files, and this checks the original layout the downloaded files
use: a random FLUX.1-width transformer with one block of each kind (531 M parameters) written as Q8_0 in both
layouts (models/tiny/gguf_layouts.py), each read by quantization/gguf.py's checks and diffusers' GGUF loader; one
forward of each must be bitwise equal, and near the float32 model's.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/gguf_flux1_layout.py      # exit 1 when the layouts differ
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from stage_runtime.config import ModelConfig, QuantizationConfig
from stage_runtime.models.families.flux import FluxAdapter
from stage_runtime.models.tiny.gguf_file import write_gguf
from stage_runtime.models.tiny.gguf_layouts import to_layout
from stage_runtime.quantization.gguf import check_gguf_file, load_gguf_denoiser

# FLUX.1's block widths (the converter's assumption); small text and latent inputs, which it does not assume
CONFIG = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
              num_attention_heads=24, joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=True,
              axes_dims_rope=(16, 56, 56))


def inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, 64, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 64, generator=g),
                pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.zeros(8, 3), guidance=torch.tensor([3.5]))


def main() -> int:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = FluxTransformer2DModel(**CONFIG).eval()
    with tempfile.TemporaryDirectory(prefix="gguf-flux1-") as tmp:
        folder = Path(tmp)
        model.save_config(folder / "transformer")
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                             "transformer": ["diffusers", "FluxTransformer2DModel"]}))
        state = model.state_dict()
        params = sum(t.numel() for t in state.values())
        write_gguf(to_layout("FluxTransformer2DModel", state, "original"), folder / "bfl.gguf", "Q8_0")
        write_gguf(state, folder / "diffusers.gguf", "Q8_0")
        with torch.no_grad():
            reference = model(**inputs()).sample
        del model, state
        outs = {}
        for name in ("bfl.gguf", "diffusers.gguf"):
            config = ModelConfig(path=str(folder))
            path, cls = check_gguf_file(FluxAdapter, config, QuantizationConfig(method="gguf", file=name))
            denoiser = load_gguf_denoiser(cls, path, config, "transformer")
            with torch.no_grad():
                outs[name] = denoiser(**inputs()).sample
            del denoiser
        size = (folder / "bfl.gguf").stat().st_size
    equal = torch.equal(outs["bfl.gguf"], outs["diffusers.gguf"])
    error = float((outs["bfl.gguf"] - reference).norm() / reference.norm())
    print(f"FLUX.1 width, 1 + 1 blocks: {params / 1e6:.0f} M parameters, Q8_0 file {size / 1e6:.0f} MB; "
          f"original layout == diffusers layout: {equal}; relative error vs float32: {error:.2e}; "
          f"{time.perf_counter() - t0:.0f} s")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
