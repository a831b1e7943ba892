"""QwenImageEditPipeline and QwenImageEditPlusPipeline (several pictures) on their tiny models: instruction edits
through the real engine equal to the bare diffusers call with the same seed (request mode <= 1, step mode <= 2),
with one fused transformer forward per step where the pipeline runs two (prompt, negative prompt). Their
``FAMILIES`` rows run the checklist (test_families.py: fused requests, shared ticks at other step counts and
guidance scales, abort, progress); here: the facts, what is refused, pictures of other sizes and aspect ratios,
the prompt-embedding cache (the text is encoded with the picture: never reused across pictures), and the keys
of the result cache and of step checkpoints, which take every picture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from engine_probes import assert_no_state, count_denoiser_calls, max_diff
from family_checks import Family, bare_pipeline, edit_pictures, generators, reference_image, to_uint8
from PIL import Image

from stage_runtime.checkpoint import request_identity
from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.engine.output_table import warmup_request
from stage_runtime.engine.result_cache import result_key
from stage_runtime.errors import InvalidRequestError
from stage_runtime.models.families.qwen_image_edit import VAE_IMAGE_SIZE, picture_sizes
from stage_runtime.models.families.qwen_vl_processor import load_processor
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

torch.set_num_threads(1)
STEPS = 3


def with_processor(path: str) -> dict:
    """The bare pipeline's processor (transformers builds the folder's own only with torchvision)."""
    return {"processor": load_processor(path)}


def edit_call(pipe, prompt: str, n: int, guidance: float) -> dict:
    """The Edit pipelines' own keywords: true CFG with the default negative prompt (the pictures: the row's)."""
    return {"prompt": prompt, "negative_prompt": " " if guidance > 1 else None, "true_cfg_scale": guidance,
            "num_images_per_prompt": n}


FAMILIES = (Family("qwen-image-edit", call=edit_call, guidances=(4.0, 2.5), pictures=(64,), pretrained=with_processor),
            Family("qwen-image-edit-plus", call=edit_call, guidances=(4.0, 2.5), pictures=(64, 48),
                   pretrained=with_processor))
EDIT, PLUS = FAMILIES


def picture(height: int, width: int, flip: bool = False) -> np.ndarray:
    """A deterministic picture of any shape (family_checks' reference image, resized)."""
    image = Image.fromarray(reference_image(max(height, width)), "RGB").resize((width, height), Image.BILINEAR)
    array = np.asarray(image)
    return np.ascontiguousarray(array[::-1] if flip else array)


def edit_request(rid: str, prompt: str, seed: int, pictures: list[np.ndarray], **kw) -> DiffusionRequest:
    sampling = {"num_inference_steps": STEPS, "seed": seed, "height": 64, "width": 64, **kw}
    return DiffusionRequest(rid, prompt, SamplingParams(**sampling),
                            edit=EditInput(pictures[0], more_images=tuple(pictures[1:])))


def bare(path: str, plus: bool, prompt: str, seed: int, pictures: list[np.ndarray], n: int = 1,
         guidance: float = 4.0, negative: str = " ") -> np.ndarray:
    """diffusers' own __call__ for one edit: one generator per image (seed + i)."""
    images = [Image.fromarray(p, "RGB") for p in pictures]
    pipe = bare_pipeline(path, **with_processor(path))
    assert isinstance(pipe, QwenImageEditPlusPipeline if plus else QwenImageEditPipeline)
    out = pipe(image=images if plus else images[0], prompt=prompt, negative_prompt=negative if guidance > 1 else None,
               true_cfg_scale=guidance, height=64, width=64, num_inference_steps=STEPS, num_images_per_prompt=n,
               generator=generators(seed, n), output_type="np")
    return to_uint8(out.images)


def engine_for(path: str, mode: str, **cache) -> DiffusionEngine:
    config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False, "cache": cache,
                          "scheduler": {"execution_mode": mode, "max_num_seqs": 4, "request_batch_max_wait_ms": 300}})
    return DiffusionEngine.make_engine(config)


@pytest.fixture(scope="module")
def edit_engine(tiny_qwen_image_edit_path):
    """Request mode, with the prompt-embedding cache on."""
    engine = engine_for(tiny_qwen_image_edit_path, "request", prompt_max_bytes=1 << 24)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def plus_engine(tiny_qwen_image_edit_plus_path):
    engine = engine_for(tiny_qwen_image_edit_plus_path, "step")
    yield engine
    engine.close()


def test_facts(edit_engine, plus_engine):
    adapter = "stage_runtime.models.families.qwen_image_edit:QwenImageEditAdapter"
    for engine, name, most in ((edit_engine, "QwenImageEditPipeline", 1),
                               (plus_engine, "QwenImageEditPlusPipeline", 4)):
        info = engine.model_info
        assert (info.pipeline_class, info.adapter) == (name, adapter)
        assert info.edit_tasks == ("instruct",) and info.edits_only and info.max_edit_images == most
        assert info.guidance == "true_cfg" and info.parallel_kinds == ("cfg",)
        assert info.lora_components == ("transformer",)                # as QwenImageLoraLoaderMixin
        assert (info.default_height, info.default_width, info.size_multiple) == (1024, 1024, 32)   # tiny VAE: 16x
        assert info.step_key == ("height", "width", "edit_shapes")
        warmup = warmup_request(info)              # the stage's warmup edits a grey picture of the default size
        assert warmup.edit is not None and warmup.edit.image.shape == (1024, 1024, 3)
        warmup.resolve(info)


def test_what_the_edit_families_cannot_do_is_refused_naming_the_field(edit_engine, plus_engine):
    square = picture(64, 64)
    cases = [(edit_engine, DiffusionRequest("gen", "a cat", SamplingParams(seed=1)), "image", "makes none from text"),
             (edit_engine, edit_request("two", "a cat", 1, [square, square]), "image[1]", "one image per request"),
             (plus_engine, edit_request("five", "a cat", 1, [square] * 5), "image[4]", "at most 4 images"),
             (plus_engine, DiffusionRequest("mask", "a cat", SamplingParams(seed=1), edit=EditInput(
                 square, np.full((64, 64), 255, np.uint8))), "mask", "inpaint"),
             (edit_engine, DiffusionRequest("strength", "a cat", SamplingParams(seed=1),
                                            edit=EditInput(square, None, 0.5)), "strength", "no strength"),
             (edit_engine, edit_request("size", "a cat", 1, [square], height=48), "height", "multiple of 32")]
    for engine, request, field, words in cases:
        with pytest.raises(InvalidRequestError, match=words) as err:
            engine.add_request(request)
        assert err.value.field == field, request.request_id
    assert_no_state(edit_engine)
    assert_no_state(plus_engine)


def test_request_mode_fuses_edits_of_one_layout_and_never_reuses_text_across_pictures(edit_engine,
                                                                                    tiny_qwen_image_edit_path):
    """Two edits of wide pictures (the conditioning grid is not square) with the same instruction, one with a
    negative prompt, fuse into one forward per step; each equals its own bare call although the prompt-embedding
    cache is on (the text is encoded with the picture). A tall picture's edit at guidance 1 runs apart."""
    path, wide, wide2, tall = tiny_qwen_image_edit_path, picture(40, 64), picture(40, 64, flip=True), picture(96, 64)
    calls = count_denoiser_calls(edit_engine)
    a = edit_engine.add_request(edit_request("a", "make it blue", 1, [wide]))
    b = edit_engine.add_request(edit_request("b", "make it blue", 2, [wide2], negative_prompt="a dog"))
    out_a, out_b = a.result(timeout=300).images, b.result(timeout=300).images
    assert calls[0] == STEPS
    ref_a = bare(path, False, "make it blue", 1, [wide])
    assert max_diff(out_a, ref_a) <= 1
    assert max_diff(out_b, bare(path, False, "make it blue", 2, [wide2], negative="a dog")) <= 1
    assert max_diff(out_a, bare(path, False, "make it blue", 1, [wide2])) > 5       # the picture matters
    plain = edit_engine.add_request(edit_request("g1", "make it blue", 3, [tall], guidance_scale=1.0))
    assert max_diff(plain.result(timeout=300).images, bare(path, False, "make it blue", 3, [tall], guidance=1.0)) <= 1
    assert edit_engine.add_request(edit_request("auto", "x", 4, [tall], height=None, width=None)).result(
        timeout=300).images.shape == (1, 96, 64, 3)          # size auto: the picture's own
    assert_no_state(edit_engine)


def test_plus_edits_of_other_picture_counts_and_shapes_run_apart_and_equal_diffusers(plus_engine,
                                                                                    tiny_qwen_image_edit_plus_path):
    """Step mode: a one-picture and a two-picture edit (wide and tall) never share a forward (their token
    layouts differ: the step key has each picture's size); each equals its bare call."""
    path, info = tiny_qwen_image_edit_plus_path, plus_engine.model_info
    one, two = [picture(64, 64)], [picture(40, 64), picture(96, 64, flip=True)]
    first, second = edit_request("one", "make it red", 5, one), edit_request("two", "swap them", 6, two, num_outputs=2)
    assert first.resolve(info).step_key != second.resolve(info).step_key
    calls = count_denoiser_calls(plus_engine)
    streams = [plus_engine.add_request(first), plus_engine.add_request(second)]
    out_one, out_two = (s.result(timeout=300).images for s in streams)
    assert calls[0] == 2 * STEPS
    assert max_diff(out_one, bare(path, True, "make it red", 5, one)) <= 2
    assert max_diff(out_two, bare(path, True, "swap them", 6, two, n=2)) <= 2
    assert_no_state(plus_engine)


def test_every_picture_is_in_the_result_cache_key_and_the_checkpoint_identity():
    a, b = edit_pictures((64, 48))
    first = edit_request("r", "x", 1, [a, b])
    other = edit_request("r", "x", 1, [a, np.ascontiguousarray(b[::-1])])
    assert result_key(first, "rev") != result_key(other, "rev")
    assert request_identity(first)["more_images"] != request_identity(other)["more_images"]
    single = edit_request("r", "x", 1, [a])
    assert "more_images" not in request_identity(single)            # one picture: the identity it always had
    assert result_key(single, "rev") != result_key(first, "rev")


@pytest.mark.parametrize("kind", ["qwen-image-edit", "qwen-image-edit-plus"])
def test_the_tiny_builds_are_what_their_docstring_says(tiny_model, kind):
    """A real folder (``model_index.json`` names Qwen2VLProcessor), loaded with the stage's processor: the Edit
    template's system prefix is the 64 tokens the pipeline drops; a square picture's megapixel is 32x32 tokens
    (a 16x VAE, whose encoder computes one convolution at the picture's full size: its cost); the VAE's
    normalised latents of its statistics picture have mean 0 and std 1; Edit-Plus modulates its picture tokens
    at timestep 0; the folder stays small."""
    import json
    from pathlib import Path

    path = Path(tiny_model(kind))
    index = json.loads((path / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    pipe = bare_pipeline(str(path), **with_processor(str(path)))
    prefix = pipe.prompt_template_encode.split("<|vision_start|>" if kind == "qwen-image-edit" else "{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 64
    assert pipe.vae_scale_factor == 16 and pipe.transformer.config.zero_cond_t == (kind == "qwen-image-edit-plus")
    assert [side // 32 for side in picture_sizes((64, 64), VAE_IMAGE_SIZE)] == [32, 32]
    side = 256
    y, x = torch.meshgrid(torch.linspace(0, 1, side), torch.linspace(0, 1, side), indexing="ij")
    stats = torch.stack([torch.sin(6 * x), torch.cos(5 * y), 2 * x * y - 1])[None, :, None]
    full_size = []
    hooks = [conv.register_forward_hook(lambda m, args, out: full_size.append(type(m).__name__)
                                        if out.shape[-2:] == (side, side) else None)
             for conv in pipe.vae.encoder.modules() if isinstance(conv, (torch.nn.Conv2d, torch.nn.Conv3d))]
    with torch.no_grad():
        latents = pipe._encode_vae_image(stats, None)
    for hook in hooks:
        hook.remove()
    assert full_size == ["QwenImageCausalConv3d"]                  # conv_in; the next one, strided, halves it
    assert latents.mean(dim=(0, 2, 3, 4)).abs().max() < 1e-3
    assert (latents.std(dim=(0, 2, 3, 4)) - 1).abs().max() < 1e-3
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 3_000_000
