"""The tiny video builders (Wan 2.1 / 2.2 A14B / TI2V-5B / I2V, LTX-2, HunyuanVideo-1.5 T2V / I2V): each writes a real
pipeline folder in code (offline), that loads back with ``DiffusionPipeline.from_pretrained`` and makes a
video; same seed, same weight files; small; every attention layer splits 2 ways; the facts the builders'
module docstrings give the adapters (VAE factors, latent channels, token counts) hold."""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from stage_runtime import model_catalog

torch.set_num_threads(1)

# kind: (pipeline class, smallest test size, bytes the folder stays under)
KINDS = {
    "wan": ("WanPipeline", 16, 500_000),
    "wan22": ("WanPipeline", 16, 650_000),
    "wan-ti2v": ("WanPipeline", 32, 600_000),
    "wan-i2v": ("WanImageToVideoPipeline", 16, 550_000),
    "wan22-i2v": ("WanImageToVideoPipeline", 16, 700_000),
    "wan-vace": ("WanVACEPipeline", 16, 700_000),
    "ltx2": ("LTX2Pipeline", 64, 1_000_000),
    "hunyuan-video15": ("HunyuanVideo15Pipeline", 16, 19_000_000),   # a fixed 2048-wide ByT5 projection
    "hunyuan-video15-i2v": ("HunyuanVideo15ImageToVideoPipeline", 16, 19_000_000),
}
PICTURE_KINDS = ("wan-i2v", "wan22-i2v", "hunyuan-video15-i2v")
SIZED_BY_PICTURE = ("hunyuan-video15-i2v",)       # __call__ takes no height and width: the picture's bucket
FRAMES = 9


def _build(kind: str, seed: int, out: Path) -> Path:
    importlib.import_module(model_catalog.tiny_builder(kind)).build(seed).save_pretrained(out)
    return out


def _weight_hashes(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*.safetensors"))}


def _load(path: Path) -> DiffusionPipeline:
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """``folder(kind)`` → that kind's pipeline folder (seed 0), written once per module on first use."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = _build(kind, 0, tmp_path_factory.mktemp(kind))
        return built[kind]

    return get


def _run(pipe, kind: str, size: int, frames: int = FRAMES, picture: tuple[int, int] | None = None, **call):
    """Two steps at ``size`` (a picture kind: from a random ``picture`` (height, width), ``size`` square by default;
    a kind sized by its picture gets no height and width)."""
    if kind in PICTURE_KINDS:
        call["image"] = Image.fromarray(np.random.default_rng(0).integers(0, 256, (*(picture or (size, size)), 3),
                                                                          dtype=np.uint8))
    if kind == "wan-vace" and "video" not in call:
        call["video"] = _clip(frames, size, size)
    if kind not in SIZED_BY_PICTURE:
        call.update(height=size, width=size)
    return pipe(prompt="a photo of a cat", negative_prompt="blurry", num_frames=frames, num_inference_steps=2,
                output_type="np", generator=torch.Generator().manual_seed(0), **call)


@pytest.mark.parametrize("kind", KINDS)
def test_folder_loads_back_and_makes_a_video(folder, kind):
    class_name, size, max_bytes = KINDS[kind]
    path = folder(kind)
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < max_bytes
    pipe = _load(path)
    assert type(pipe).__name__ == class_name
    frames = _run(pipe, kind, size).frames
    assert frames.shape == (1, FRAMES, size, size, 3) and frames.dtype == np.float32
    assert np.isfinite(frames).all() and frames.std() > 0.02


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_weight_files_other_seed_others(folder, tmp_path, kind):
    again = _weight_hashes(_build(kind, 0, tmp_path / "again"))
    other = _weight_hashes(_build(kind, 1, tmp_path / "other"))
    assert again == _weight_hashes(folder(kind))
    assert other.keys() == again.keys() and all(other[name] != again[name] for name in again)


def _config_heads(config: dict) -> list[int]:
    """Every ``*heads`` number in a (nested) config: attention heads, key/value heads, audio and connector heads."""
    counts: list[int] = []
    for key, value in config.items():
        if isinstance(value, dict):
            counts += _config_heads(value)
        elif str(key).endswith("heads") and isinstance(value, int):
            counts.append(value)
    return counts


def _head_counts(part: torch.nn.Module) -> list[int]:
    """The head counts of a component: its attention modules' own and its config's (transformers' attention
    modules read theirs from the config)."""
    config = part.config.to_dict() if hasattr(part.config, "to_dict") else dict(part.config)
    return _config_heads(config) + [count for m in part.modules() for name in ("heads", "num_heads", "n_heads")
                                    if isinstance(count := vars(m).get(name), int)]


@pytest.mark.parametrize("kind", KINDS)
def test_every_attention_layer_splits_two_ways(kind):
    pipe = importlib.import_module(model_catalog.tiny_builder(kind)).build(0)
    counts = {name: _head_counts(part) for name, part in pipe.components.items() if isinstance(part, torch.nn.Module)}
    assert counts["transformer"] and counts["text_encoder"]
    assert all(count % 2 == 0 for per_part in counts.values() for count in per_part), counts


# kind: (VAE spatial factor, VAE temporal factor, latent channels, text tokens the pipeline pads the prompt to)
FACTS = {
    "wan": (8, 4, 16, 512),
    "wan22": (8, 4, 16, 512),
    "wan-ti2v": (16, 4, 48, 512),
    "wan-i2v": (8, 4, 16, 512),
    "wan22-i2v": (8, 4, 16, 512),
    "wan-vace": (8, 4, 16, 512),
    "ltx2": (32, 8, 8, 1024),
    "hunyuan-video15": (4, 4, 4, 1000),
    "hunyuan-video15-i2v": (4, 4, 4, 1000),
}


def _default(function, name: str):
    import inspect

    return inspect.signature(function).parameters[name].default


@pytest.mark.parametrize("kind", KINDS)
def test_module_docstring_facts(folder, kind):
    """The numbers each builder's docstring gives the adapters: VAE factors, latent channels, text length."""
    spatial, temporal, channels, text_tokens = FACTS[kind]
    pipe = _load(folder(kind))
    if kind.startswith("hunyuan-video15"):
        factors = (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal, pipe.num_channels_latents,
                   pipe.tokenizer_max_length)
    elif kind == "ltx2":
        factors = (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio,
                   pipe.transformer.config.in_channels, _default(type(pipe).__call__, "max_sequence_length"))
        assert _default(type(pipe).__call__, "frame_rate") == 24.0
    else:
        factors = (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal, pipe.vae.config.z_dim,
                   _default(type(pipe).__call__, "max_sequence_length"))
    assert factors == (spatial, temporal, channels, text_tokens)
    assert pipe.transformer.config.out_channels == channels


def test_wan_rounds_frames_down_to_4k_plus_1_and_refuses_sizes_off_16(folder):
    pipe = _load(folder("wan"))
    assert _run(pipe, "wan", 16, frames=10).frames.shape[1] == 9
    with pytest.raises(ValueError, match="divisible by 16"):
        _run(pipe, "wan", 24)


def test_wan22_two_steps_run_both_experts_each_with_its_guidance(folder):
    pipe = _load(folder("wan22"))
    assert pipe.config.boundary_ratio == 0.875 and pipe.transformer_2 is not None
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    _run(pipe, "wan22", 16, guidance_scale=5.0, guidance_scale_2=3.0)
    assert calls == {"transformer": 2, "transformer_2": 2}          # step 1 (t=999) high noise, step 2 (t=750) low


def test_wan_ti2v_takes_a_timestep_per_token_and_rounds_sizes_to_32(folder):
    pipe = _load(folder("wan-ti2v"))
    assert pipe.config.expand_timesteps and pipe.transformer_2 is None
    assert _run(pipe, "wan-ti2v", 48).frames.shape[2:4] == (32, 32)


def test_wan_i2v_sends_the_clip_penultimate_tokens_to_the_transformer(folder):
    pipe = _load(folder("wan-i2v"))
    image = Image.new("RGB", (16, 16), (200, 30, 30))
    tokens = pipe.encode_image(image, torch.device("cpu"))
    assert tokens.shape == (1, 17, pipe.transformer.config.image_dim)
    assert pipe.transformer.config.in_channels == 2 * pipe.vae.config.z_dim + 4


def test_wan22_i2v_has_two_experts_no_image_encoder_and_runs_both_from_the_image(folder):
    pipe = _load(folder("wan22-i2v"))
    assert pipe.config.boundary_ratio == 0.9 and pipe.image_encoder is None and pipe.transformer.config.image_dim is None
    assert pipe.transformer.config.in_channels == pipe.transformer_2.config.in_channels == 2 * pipe.vae.config.z_dim + 4
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    _run(pipe, "wan22-i2v", 16, guidance_scale=5.0, guidance_scale_2=3.0)
    assert calls == {"transformer": 2, "transformer_2": 2}          # step 1 (t=999) high noise, step 2 low


def _clip(frames: int, height: int, width: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(frames)]


def test_wan_vace_control_channels_references_and_one_video_per_call(folder):
    """The VACE facts of tiny/wan_vace.py: 96 control channels (32 video latents + the mask folded 8 x 8), a VACE
    block beside each layer; a reference image adds one latent frame to the control and the noise (dropped when
    decoding); a list prompt or a list of generators raises."""
    pipe = _load(folder("wan-vace"))
    config = pipe.transformer.config
    assert (config.vace_in_channels, list(config.vace_layers), config.num_layers) == (96, [0, 1], 2)
    shapes = []
    pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append((kw["hidden_states"].shape, kw["control_hidden_states"].shape)),
        with_kwargs=True)
    mask = [Image.new("RGB", (16, 16), "white")] * FRAMES
    out = _run(pipe, "wan-vace", 16, mask=mask, reference_images=[_clip(1, 24, 16)[0]], guidance_scale=1.0)
    assert out.frames.shape == (1, FRAMES, 16, 16, 3)
    assert shapes[0] == ((1, 16, 4, 2, 2), (1, 96, 4, 2, 2))          # 3 video latent frames + 1 reference
    for call, refusal in (({"generator": [torch.Generator().manual_seed(0)]}, "list of generators"),
                          ({"prompt": ["a", "b"]}, "list of prompts")):
        with pytest.raises(ValueError, match=refusal):
            pipe(**{"prompt": "a", **call}, video=_clip(FRAMES, 16, 16), height=16, width=16, num_frames=FRAMES,
                 num_inference_steps=1)


def test_ltx2_makes_sound_as_long_as_the_video(folder):
    pipe = _load(folder("ltx2"))
    out = _run(pipe, "ltx2", 64, frames=17, frame_rate=24.0)
    assert out.frames.shape == (1, 17, 64, 64, 3)
    rate = pipe.vocoder.config.output_sampling_rate
    assert out.audio.shape[:2] == (1, 2) and torch.isfinite(out.audio).all() and out.audio.std() > 0
    assert abs(out.audio.shape[2] / rate - 17 / 24.0) < 0.1


def test_ltx2_refuses_sizes_off_32(folder):
    with pytest.raises(ValueError, match="divisible by 32"):
        _run(_load(folder("ltx2")), "ltx2", 48)


def test_hunyuan_video15_crop_drops_exactly_the_system_prompt(folder):
    """The pipeline drops the first 108 chat-template tokens: the tiny vocabulary encodes them as 108 too."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    pipe = _load(folder("hunyuan-video15"))
    conversation = format_text_input(["a red car"], pipe.system_message)
    ids = pipe.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"][0]
    start = pipe.prompt_template_encode_start_idx
    assert start == 108
    assert pipe.tokenizer.convert_ids_to_tokens(ids[start - 1:start + 4]) == ["Ċ", "a", "Ġred", "Ġcar", "<|im_end|>"]
    assert pipe.guider.guidance_scale > 1 and pipe.guider.num_conditions == 2


def test_hunyuan_video15_byt5_reads_only_quoted_text(folder):
    pipe = _load(folder("hunyuan-video15"))
    plain, plain_mask = pipe._get_byt5_prompt_embeds(pipe.tokenizer_2, pipe.text_encoder_2, "a cat", "cpu")
    quoted, quoted_mask = pipe._get_byt5_prompt_embeds(pipe.tokenizer_2, pipe.text_encoder_2, 'a sign "OPEN"', "cpu")
    assert plain.shape == quoted.shape == (1, 256, pipe.text_encoder_2.config.d_model)
    assert plain_mask.sum() == 0 and quoted_mask.sum() > 0 and quoted.abs().sum() > 0


def test_hunyuan_video15_i2v_encodes_the_picture_with_siglip_and_sizes_the_video_by_it(folder):
    """SigLIP gives 16 image tokens as wide as the transformer's image_embed_dim; the video is the bucket (of target
    16 in steps of 4) nearest the picture's aspect ratio on its side of square, the picture cropped to it."""
    pipe = _load(folder("hunyuan-video15-i2v"))
    tokens = pipe.encode_image(Image.new("RGB", (24, 12), (200, 30, 30)), 2, torch.device("cpu"), torch.float32)
    assert tokens.shape == (2, 16, pipe.transformer.config.image_embed_dim) and tokens.abs().sum() > 0
    assert pipe.transformer.config.task_type == "i2v" and not pipe.transformer.config.use_meanflow
    assert pipe.transformer.config.in_channels == 2 * pipe.num_channels_latents + 1
    for picture, video in (((12, 24), (12, 20)), ((24, 12), (20, 12)), ((10, 40), (8, 32))):
        assert _run(pipe, "hunyuan-video15-i2v", 16, picture=picture).frames.shape[2:4] == video


def test_gemma_tokenizer_encodes_words_whole_bytes_otherwise_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    from stage_runtime.models.tiny.gemma_tokenizer import build_gemma_tokenizer

    tok = build_gemma_tokenizer()
    ids = tok("a photo of a cat").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "a", "\u2581photo", "\u2581of", "\u2581a", "\u2581cat"]
    odd = tok("Zebra #42! é").input_ids
    assert tok.unk_token_id not in odd and tok.decode(odd, skip_special_tokens=True) == "Zebra #42! é"
    padded = tok("a cat", padding="max_length", max_length=5).input_ids          # Gemma pads on the left
    assert padded == [tok.pad_token_id, tok.pad_token_id, tok.bos_token_id, ids[1], ids[5]]
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "GemmaTokenizer" and loaded("a photo of a cat").input_ids == ids
