"""LoRA adapters on the Qwen-Image-Edit pipelines (Edit: one picture; Edit-Plus: several): the transformer's
adapters, as diffusers' QwenImageLoraLoaderMixin loads them, applied per row of the fused forward. A step-mode tick
holding a request without adapters, one with ``a`` and one with ``a`` and ``b`` mixed, each equal to the bare Edit
pipeline with ``load_lora_weights`` + ``set_adapters`` of the same files (step mode: within 2 uint8), and request mode
likewise (within 1; the same per-row path, on Edit-Plus)."""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from engine_probes import max_diff
from family_checks import edit_pictures, generators, to_uint8
from lora_probes import write_adapter
from PIL import Image

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.models.families.qwen_vl_processor import load_processor
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

STEPS, GUIDANCE, PROMPT = 3, 4.0, "make it blue"
KINDS = {"qwen-image-edit": (QwenImageEditPipeline, (64,)), "qwen-image-edit-plus": (QwenImageEditPlusPipeline, (64, 48))}
SETS = {"base": (), "a": ({"name": "a", "scale": 1.0},), "ab": ({"name": "a", "scale": 0.6}, {"name": "b", "scale": -0.5})}


@pytest.fixture(scope="module")
def made(tiny_model, tmp_path_factory):
    """kind → (its folder, its two adapters, diffusers' pipeline with both loaded): written and loaded once."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            path, out = tiny_model(kind), tmp_path_factory.mktemp(f"lora-{kind}")
            adapters = {n: write_adapter(path, out / n, seed=s, text_encoder=False, gain=1.0)
                        for n, s in (("a", 1), ("b", 2))}
            pipe = KINDS[kind][0].from_pretrained(path, local_files_only=True, processor=load_processor(path))
            pipe.set_progress_bar_config(disable=True)
            for name, adapter in adapters.items():
                pipe.load_lora_weights(adapter, adapter_name=name)
            cache[kind] = path, adapters, pipe
        return cache[kind]

    return get


def bare(pipe, kind: str, loras: tuple, seed: int) -> np.ndarray:
    """diffusers' own call with ``set_adapters`` of the set (none: the adapters disabled)."""
    if loras:
        pipe.enable_lora()
        pipe.set_adapters([ref["name"] for ref in loras], [ref["scale"] for ref in loras])
    else:
        pipe.disable_lora()
    images = [Image.fromarray(p, "RGB") for p in edit_pictures(KINDS[kind][1])]
    out = pipe(image=images if len(images) > 1 else images[0], prompt=PROMPT, negative_prompt=" ",
               true_cfg_scale=GUIDANCE, height=64, width=64, num_inference_steps=STEPS, generator=generators(seed, 1),
               output_type="np")
    return to_uint8(out.images)


@pytest.mark.parametrize("kind, mode", [("qwen-image-edit", "step"), ("qwen-image-edit-plus", "step"),
                                        ("qwen-image-edit-plus", "request")])
def test_each_row_gets_its_own_adapters_equal_to_diffusers(kind, mode, made):
    path, adapters, pipe = made(kind)
    pictures = edit_pictures(KINDS[kind][1])
    engine = DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "warmup": False,
        "loras": [{"name": n, "path": p} for n, p in adapters.items()],
        "scheduler": {"execution_mode": mode, "max_num_seqs": 4, "request_batch_max_wait_ms": 300}}))
    try:
        with engine._lock:                              # admitted together: one tick (step) or one wave (request)
            streams = {name: engine.add_request(DiffusionRequest(name, PROMPT, SamplingParams(
                num_inference_steps=STEPS, seed=i, height=64, width=64, guidance_scale=GUIDANCE, loras=loras),
                edit=EditInput(pictures[0], more_images=tuple(pictures[1:]))))
                for i, (name, loras) in enumerate(SETS.items())}
        ours = {name: s.result(timeout=300).images for name, s in streams.items()}
    finally:
        engine.close()
    tolerance = 2 if mode == "step" else 1
    for i, (name, loras) in enumerate(SETS.items()):
        assert max_diff(ours[name], bare(pipe, kind, loras, i)) <= tolerance, name
    assert max_diff(ours["a"], ours["base"]) >= 3, "the adapter changed nothing"
