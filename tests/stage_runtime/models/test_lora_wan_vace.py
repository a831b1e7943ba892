"""LoRA on Wan VACE (models/families/wan_vace.py, models/lora): what users of VACE serve beside it — a step-distilled
Wan LoRA as its authors publish it (lightx2v / CausVid: ``diffusion_model.blocks.N.…`` with ``alpha`` and ``diff_b``,
adapting the Wan blocks only) and an adapter trained on the VACE transformer itself (PEFT keys saved by diffusers,
on its Wan blocks and its VACE blocks alike) — each served per row beside a video-to-video request without it in one
step tick, each equal to diffusers' ``WanVACEPipeline.load_lora_weights`` + ``set_adapters`` on the same video, mask
and reference picture, on every frame."""

from __future__ import annotations

import pytest
import torch
from engine_probes import max_diff, run_together, runner_of
from family_checks import Family, source_video, to_uint8, video_keywords
from lora_probes import load_pipe, original_layout_file, write_adapter

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine

torch.set_num_threads(1)
ROW = Family("wan-vace", size=16, frames=9, video_input=True)
PROMPT, STEPS, SCALE, GUIDANCE = "a red fox running", 3, 0.8, 5.0


@pytest.fixture(scope="module")
def files(tiny_wan_vace_path, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("vace-loras")
    return {"distill": str(original_layout_file(tiny_wan_vace_path, out / "distill", seed=8, biases=True)),
            "vace": write_adapter(tiny_wan_vace_path, out / "vace", seed=6, text_encoder=False, gain=3.0)}


@pytest.fixture(scope="module")
def engines(tiny_wan_vace_path, files):
    made = {mode: DiffusionEngine(load_config({
        "model": {"path": tiny_wan_vace_path}, "device": "cpu", "warmup": False,
        "loras": [{"name": name, "path": path} for name, path in files.items()],
        "scheduler": {"execution_mode": mode, "max_num_seqs": 2}})) for mode in ("request", "step")}
    yield made
    for engine in made.values():
        engine.close()


def request(rid: str, lora: str | None, seed: int):
    return ROW.request(rid, PROMPT, STEPS, seed, guidance_scale=GUIDANCE,
                       loras=[{"name": lora, "scale": SCALE}] if lora else [])


def bare(path: str, adapter: str | None, seed: int):
    """WanVACEPipeline's own call on the request's video, mask and reference, with the adapter loaded as diffusers
    loads it (none: the base model)."""
    pipe = load_pipe(path)
    if adapter is not None:
        pipe.load_lora_weights(adapter, adapter_name="a")
        pipe.set_adapters(["a"], [SCALE])
    out = pipe(prompt=PROMPT, height=ROW.size, width=ROW.size, num_frames=ROW.frames, num_inference_steps=STEPS,
               guidance_scale=GUIDANCE, generator=torch.Generator().manual_seed(seed), output_type="np",
               **video_keywords(source_video(ROW.size, ROW.frames)))
    return to_uint8(out.frames)


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("lora", ["distill", "vace"])
def test_an_adapter_beside_a_plain_video_to_video_request_equals_diffusers(tiny_wan_vace_path, files, engines, lora,
                                                                          mode):
    engine = engines[mode]
    calls = [0]
    handle = runner_of(engine).adapter.denoiser.register_forward_pre_hook(
        lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
    try:
        out = run_together(engine, [request("adapted", lora, seed=1), request("plain", None, seed=2)])
    finally:
        handle.remove()
    assert calls[0] == STEPS                                        # both rows in every forward
    adapted, plain = out["adapted"].images, out["plain"].images
    assert adapted.shape == (1, ROW.frames, ROW.size, ROW.size, 3)
    tol = 1 if mode == "request" else 2
    assert max_diff(adapted, bare(tiny_wan_vace_path, files[lora], seed=1)) <= tol
    assert max_diff(plain, bare(tiny_wan_vace_path, None, seed=2)) <= tol
    assert max_diff(adapted, bare(tiny_wan_vace_path, None, seed=1)) > 5          # the adapter changes the video


def test_an_adapter_on_the_vace_blocks_adapts_them(files, engines):
    """The VACE transformer's own adapter has factors on its VACE blocks too (the control branch), not only on the
    Wan blocks a step-distill file adapts."""
    listed = {a["name"]: a for a in engines["step"].collective_rpc("list_loras")}
    assert set(listed) == {"distill", "vace"}
    held = runner_of(engines["step"]).adapter.loras.adapters
    vace_modules = [m for m in held["vace"].modules["transformer"] if m.startswith("vace_blocks.")]
    distill_modules = list(held["distill"].modules["transformer"])
    assert vace_modules and not any(m.startswith("vace_blocks.") for m in distill_modules)
