"""HunyuanVideo15Pipeline: its facts, its frame and size rules at admission, its guider (the folder's settings,
a scale per request, CFG rows only on the steps it guides, the negative prompt), the ByT5 glyph text per row,
and a guider it cannot run refused at load; its ``FAMILY`` row runs the checklist (test_families.py).

The tiny random model barely shows guidance in the decoded uint8 frames (a few levels), so the particular
checks compare the latents the VAE decodes with the bare call's (1e-4), after checking the bare call itself
moves them by far more than that when the setting changes.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from engine_probes import assert_no_state, max_diff, runner_of
from family_checks import Family, bare_call, bare_pipeline, guider_call, make_engine

from stage_runtime.config import ModelConfig
from stage_runtime.errors import InvalidRequestError, ModelLoadError
from stage_runtime.models.registry import resolve_adapter_class

torch.set_num_threads(1)
LATENT_ATOL = 1e-4
MOVED = 5e-3           # what a changed setting moves the bare call's latents by, at least (measured 0.015-0.04)


FAMILY = Family("hunyuan-video15", call=guider_call, guidances=(6.0, 3.0), size=16, frames=9)


class Taps:
    """What one pipeline's transformer and VAE decoder are given: rows and ByT5 mask sums per forward, and the
    latents of each video decoded (the VAE gets one video a call, in the engine and in the bare call)."""

    def __init__(self, pipe):
        self.rows, self.glyph_tokens, self.decoded = [], [], []
        self.hooks = [pipe.transformer.register_forward_pre_hook(self.forward, with_kwargs=True),
                      pipe.vae.decoder.register_forward_pre_hook(lambda _m, args: self.decoded.append(args[0].clone()))]

    def forward(self, _module, _args, kwargs):
        self.rows.append(len(kwargs["hidden_states"]))
        self.glyph_tokens.append(kwargs["encoder_attention_mask_2"].sum(1).int().tolist())


@contextlib.contextmanager
def tapped(pipe):
    taps = Taps(pipe)
    try:
        yield taps
    finally:
        for hook in taps.hooks:
            hook.remove()


def bare_latents(path: str, prompt: str, steps: int, seed: int, guidance: float, **extra) -> torch.Tensor:
    """The latents the bare call decodes (its one video)."""
    with tapped(bare_pipeline(path)) as taps:
        bare_call(FAMILY, path, prompt, steps, seed, guidance, **extra)
    (latents,) = taps.decoded
    return latents


def far(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) > MOVED


def assert_decoded(decoded: list[torch.Tensor], *wants: torch.Tensor) -> None:
    """Each wanted video's latents were decoded once (within LATENT_ATOL), whichever request finished first."""
    assert len(decoded) == len(wants)
    for want in wants:
        assert min(float((d - want).abs().max()) for d in decoded) <= LATENT_ATOL


def variant(tiny: str, out: Path, guider) -> str:
    """The tiny folder with another guider component (the rest linked, not copied)."""
    out.mkdir()
    for item in Path(tiny).iterdir():
        if item.name not in ("guider", "model_index.json"):
            (out / item.name).symlink_to(item)
    guider.save_pretrained(out / "guider")
    index = json.loads((Path(tiny) / "model_index.json").read_text())
    index["guider"] = ["diffusers", type(guider).__name__]
    (out / "model_index.json").write_text(json.dumps(index))
    return str(out)


@pytest.fixture(scope="module")
def tiny_path(tiny_hunyuan_video15_path) -> str:
    return tiny_hunyuan_video15_path


@pytest.fixture(scope="module")
def engines(tiny_path):
    """``engines(mode)`` → an engine over the tiny folder in that mode, made once per module."""
    made = {}

    def get(mode: str):
        if mode not in made:
            wait = {"request_batch_max_wait_ms": 200} if mode == "request" else {}
            made[mode] = make_engine(tiny_path, mode, max_num_seqs=4, warmup=False, **wait)
        return made[mode]

    yield get
    for engine in made.values():
        engine.close()


@pytest.fixture(scope="module")
def step_engine(engines):
    return engines("step")


def test_facts(tiny_path):
    info = resolve_adapter_class(ModelConfig(path=tiny_path)).load(tiny_path, torch.device("cpu")).info()
    assert (info.pipeline_class, info.adapter) == ("HunyuanVideo15Pipeline",
                                                   "stage_runtime.models.families.hunyuan_video15:HunyuanVideo15Adapter")
    assert info.video and info.frame_rule == (4, 1) and (info.default_frames, info.default_fps) == (121, 24)
    # the pipeline's own default: the 16:9 bucket nearest target_size 16 in steps of the VAE factor 4
    assert (info.default_height, info.default_width, info.size_multiple) == (12, 20, 4)
    assert (info.default_guidance, info.guidance, info.max_sequence_length) == (6.0, "cfg", 1000)
    assert info.step_key == ("height", "width", "num_frames") and not info.takes_guidance_2
    assert info.supports_step_execution and info.parallel_kinds == ("cfg", "ring", "ulysses")


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_frames": 10}, r"^num_frames=10: HunyuanVideo15Pipeline takes 4k\+1 frames \(9, 13 are the nearest\)"),
    ({"num_frames": 8}, r"^num_frames=8: HunyuanVideo15Pipeline takes 4k\+1 frames \(5, 9 are the nearest\)"),
    ({"height": 18}, r"^height=18: must be a multiple of 4"),
])
def test_a_frame_count_or_size_off_the_rule_is_refused_at_admission_naming_the_field(step_engine, fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        step_engine.add_request(FAMILY.request("r", "a cat", 2, 1, **fields))
    assert_no_state(step_engine)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_folders_guider_guides_only_the_steps_in_its_window_with_its_rescale(tiny_path, tmp_path, mode):
    """A guider with a window (start 0.25, stop 0.75: of 4 steps, CFG on steps 1 and 2) and guidance_rescale:
    one row a step outside the window, two inside, and the latents of the bare call with that guider."""
    from diffusers.guiders import ClassifierFreeGuidance

    path = variant(tiny_path, tmp_path / "windowed",
                   ClassifierFreeGuidance(guidance_scale=6.0, guidance_rescale=0.7, start=0.25, stop=0.75))
    want = bare_latents(path, "a cat", 4, 1, 6.0)
    assert far(want, bare_latents(tiny_path, "a cat", 4, 1, 6.0))
    engine = make_engine(path, mode, warmup=False)
    try:
        with tapped(runner_of(engine).adapter.pipe) as taps:
            out = engine.add_request(FAMILY.request("w", "a cat", 4, 1, guidance_scale=6.0)).result(timeout=60)
        assert_no_state(engine)
    finally:
        engine.close()
    assert taps.rows == [1, 2, 2, 1]
    assert_decoded(taps.decoded, want)
    assert max_diff(out.images, bare_call(FAMILY, path, "a cat", 4, 1, 6.0)) <= 1


@pytest.mark.parametrize("mode", ["request", "step"])
def test_each_request_is_guided_at_its_own_scale_and_negative_prompt_in_one_forward(engines, tiny_path, mode):
    """A request at scale 6 with a negative prompt and one at scale 1 (CFG off: one row) share forwards (2 + 1
    rows): one request-mode call (the same step count), or step mode's ticks (4 and 2 steps); each decodes the
    latents of its own bare call."""
    engine, short = engines(mode), 4 if mode == "request" else 2
    with_negative = bare_latents(tiny_path, "a cat", 4, 1, 6.0, negative_prompt=["blurry"])
    unguided = bare_latents(tiny_path, "a cat", short, 2, 1.0)
    assert far(with_negative, bare_latents(tiny_path, "a cat", 4, 1, 6.0))
    assert far(unguided, bare_latents(tiny_path, "a cat", short, 2, 6.0))
    with tapped(runner_of(engine).adapter.pipe) as taps:
        guided = engine.add_request(FAMILY.request("g", "a cat", 4, 1, guidance_scale=6.0, negative_prompt="blurry"))
        plain = engine.add_request(FAMILY.request("p", "a cat", short, 2, guidance_scale=1.0))
        guided.result(timeout=60), plain.result(timeout=60)
    assert sorted(taps.rows) == ([3, 3, 3, 3] if mode == "request" else [2, 2, 3, 3])   # 4 forwards: shared
    assert_decoded(taps.decoded, with_negative, unguided)
    assert_no_state(engine)


def test_the_glyph_text_is_encoded_by_byt5_per_row(step_engine, tiny_path):
    """Only the quoted text of a prompt reaches ByT5 (``Text "OPEN". ``: 13 bytes and the end token); a prompt
    without quotes and the empty negative prompt have none. A glyph prompt and a plain one share ticks, each
    row with its own ByT5 mask, and each decodes its bare call's latents."""
    glyph, plain = 'a shop sign that reads "OPEN"', "a shop sign that reads OPEN"
    want_glyph, want_plain = bare_latents(tiny_path, glyph, 3, 4, 6.0), bare_latents(tiny_path, plain, 2, 4, 6.0)
    assert far(want_glyph, bare_latents(tiny_path, plain, 3, 4, 6.0))
    with tapped(runner_of(step_engine).adapter.pipe) as taps:
        a = step_engine.add_request(FAMILY.request("glyph", glyph, 3, 4, guidance_scale=6.0))
        b = step_engine.add_request(FAMILY.request("plain", plain, 2, 4, guidance_scale=6.0))
        a.result(timeout=60), b.result(timeout=60)
    # [cond, uncond] rows of each request: the glyph prompt's cond row alone has ByT5 tokens; two ticks shared
    assert sorted(sorted(tick) for tick in taps.glyph_tokens) == [[0, 0, 0, 14], [0, 0, 0, 14], [0, 14]]
    assert_decoded(taps.decoded, want_glyph, want_plain)
    assert_no_state(step_engine)


def test_a_guider_it_cannot_run_is_refused_at_load_naming_it(tiny_path, tmp_path):
    from diffusers.guiders import AdaptiveProjectedGuidance

    path = variant(tiny_path, tmp_path / "apg", AdaptiveProjectedGuidance())
    with pytest.raises(ModelLoadError, match=r"^guider=AdaptiveProjectedGuidance: HunyuanVideo15Pipeline is served "
                                             r"with a ClassifierFreeGuidance guider only"):
        resolve_adapter_class(ModelConfig(path=path)).load(path, torch.device("cpu"))
