"""WanPipeline (Wan 2.1, Wan 2.2 A14B's two experts, TI2V-5B: text to video, and image to video with a first
frame, as WanImageToVideoPipeline runs that folder) and WanImageToVideoPipeline (Wan 2.1 I2V with CLIP
image tokens, Wan 2.2 I2V A14B's two experts without them): its facts, the frame rule at admission, both experts
running with their own guidance (equal to the bare call, step batching of different step counts and guidance
scales, abort and progress: its ``FAMILIES`` rows in the checklist, test_families.py)."""

from __future__ import annotations

import pytest
import torch
from engine_probes import assert_no_state, count_denoiser_calls, max_diff, runner_of
from family_checks import Family, bare_call, make_engine

from stage_runtime.config import ModelConfig
from stage_runtime.errors import InvalidRequestError
from stage_runtime.models.registry import resolve_adapter_class

torch.set_num_threads(1)
FAMILIES = (Family("wan", guidances=(6.0, 3.0), size=16, frames=9),
            Family("wan22", guidances=(6.0, 3.0), size=16, frames=9),
            Family("wan-ti2v", guidances=(5.0, 2.0), size=32, frames=9),
            Family("wan-ti2v", guidances=(5.0, 2.0), size=32, frames=9, reference=True,
                   pipeline_class="WanImageToVideoPipeline", label="wan-ti2v-i2v"),
            Family("wan-i2v", guidances=(5.0, 2.0), size=16, frames=9, reference=True),
            Family("wan22-i2v", guidances=(5.0, 2.0), size=16, frames=9, reference=True))
WAN22 = FAMILIES[1]


def test_facts(tiny_wan_path, tiny_wan22_path):
    info = resolve_adapter_class(ModelConfig(path=tiny_wan_path)).load(tiny_wan_path, torch.device("cpu")).info()
    assert (info.pipeline_class, info.adapter) == ("WanPipeline", "stage_runtime.models.families.wan:WanAdapter")
    assert info.video and info.frame_rule == (4, 1) and (info.default_frames, info.default_fps) == (81, 16)
    assert (info.default_height, info.default_width, info.size_multiple) == (480, 832, 16)
    assert info.step_key == ("height", "width", "num_frames") and not info.takes_guidance_2
    assert info.lora_components == ("transformer",)
    two = resolve_adapter_class(ModelConfig(path=tiny_wan22_path)).load(tiny_wan22_path, torch.device("cpu")).info()
    assert two.takes_guidance_2 and two.lora_components == ("transformer", "transformer_2")


def test_a_frame_count_off_the_rule_is_refused_at_admission_naming_the_field(tiny_wan_path):
    engine = make_engine(tiny_wan_path, warmup=False)
    try:
        with pytest.raises(InvalidRequestError, match=r"^num_frames=10: WanPipeline takes 4k\+1 frames \(9, 13"):
            engine.add_request(WAN22.request("r", "a cat", 2, 1, num_frames=10))
        assert_no_state(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["request", "step"])
def test_wan22_runs_both_experts_each_with_its_guidance(tiny_wan22_path, mode):
    """Wan 2.2: high-noise steps on ``transformer`` at guidance_scale, the rest on ``transformer_2`` at
    guidance_scale_2; equal to diffusers with both scales, and different from a run that ignored the second."""
    engine = make_engine(tiny_wan22_path, mode, warmup=False, max_num_seqs=2)
    experts = runner_of(engine).adapter.experts
    calls = {"high": 0, "low": 0}
    hooks = [expert.register_forward_pre_hook(lambda _m, _a, k=k: calls.__setitem__(k, calls[k] + 1))
             for k, expert in (("high", experts.transformer), ("low", experts.transformer_2))]
    try:
        out = engine.add_request(WAN22.request("a", "a red car", 6, 2, guidance_scale=6.0,
                                               guidance_scale_2=40.0)).result(timeout=120).images
    finally:
        for hook in hooks:
            hook.remove()
        engine.close()
    assert calls["high"] >= 1 and calls["low"] >= 1 and calls["high"] + calls["low"] == 6
    both = bare_call(WAN22, tiny_wan22_path, "a red car", 6, 2, 6.0, guidance_scale_2=40.0)
    assert max_diff(out, both) <= (1 if mode == "request" else 2)


def test_a_low_noise_step_is_guided_by_guidance_scale_2_on_transformer_2(tiny_wan22_path):
    """The tiny random experts barely respond to guidance late in the schedule (the videos above differ by 1
    uint8 whatever guidance_scale_2 is), so the step itself is checked: past the boundary, the prediction is
    transformer_2's uncond + guidance_scale_2 x (cond - uncond), as WanPipeline computes it."""
    adapter = resolve_adapter_class(ModelConfig(path=tiny_wan22_path)).load(tiny_wan22_path, torch.device("cpu"))
    request = WAN22.request("r", "a red car", 6, 2, guidance_scale=6.0, guidance_scale_2=40.0).resolve(adapter.info())
    state = adapter.prepare_encode(request)
    while bool(adapter.experts.high_noise(state.timestep.reshape(1))[0]):
        adapter.noise_step(state, adapter.denoise_step([state])[0])
    (pred,) = adapter.denoise_step([state])
    cond, uncond = (adapter.pipe.transformer_2(hidden_states=state.latents, timestep=state.timestep.expand(1),
                                               encoder_hidden_states=embeds[None], return_dict=False)[0]
                    for embeds in state.cond["embeds"])
    torch.testing.assert_close(pred, uncond + 40.0 * (cond - uncond), rtol=1e-3, atol=1e-4)
    assert (pred - (uncond + 6.0 * (cond - uncond))).abs().max() > 1e-2


def test_ti2v_text_and_image_requests_share_one_forward_per_step(tiny_wan_ti2v_path):
    """TI2V-5B: a text-to-video and an image-to-video request in the same ticks (the reference is in neither key:
    every row takes a timestep per token, 0 on a first frame's), each equal to its own bare call, and the picture
    is the first frame."""
    t2v, i2v = (f for f in FAMILIES if f.kind == "wan-ti2v")
    engine = make_engine(tiny_wan_ti2v_path, "step", warmup=False, max_num_seqs=2)
    calls = count_denoiser_calls(engine)
    try:
        with engine._lock:                                   # admitted together: they share every tick
            text = engine.add_request(t2v.request("text", "a red car", 3, 1, guidance_scale=5.0))
            image = engine.add_request(i2v.request("image", "a red car", 3, 2, guidance_scale=5.0))
        got = {"text": text.result(timeout=120).images, "image": image.result(timeout=120).images}
        assert_no_state(engine)
    finally:
        engine.close()
    assert calls[0] == 3, f"{calls[0]} forwards for two 3-step requests admitted together"
    assert max_diff(got["text"], bare_call(t2v, tiny_wan_ti2v_path, "a red car", 3, 1, 5.0)) <= 2
    assert max_diff(got["image"], bare_call(i2v, tiny_wan_ti2v_path, "a red car", 3, 2, 5.0)) <= 2
    assert max_diff(got["image"], bare_call(t2v, tiny_wan_ti2v_path, "a red car", 3, 2, 5.0)) > 10, \
        "the picture conditions the video"


def test_a_ti2v_folder_saved_as_the_image_to_video_class_is_served_too(tiny_wan_ti2v_path, tmp_path):
    """TI2V-5B saved as ``WanImageToVideoPipeline`` (``expand_timesteps`` in its config): the image is required, and
    the video equals that class's own call."""
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline

    folder = tmp_path / "ti2v-as-i2v"
    base = DiffusionPipeline.from_pretrained(tiny_wan_ti2v_path, local_files_only=True)
    WanImageToVideoPipeline(**base.components, expand_timesteps=True).save_pretrained(folder)
    row = Family("wan-ti2v", size=32, frames=9, reference=True)
    engine = make_engine(str(folder), "request", warmup=False)
    try:
        assert runner_of(engine).adapter.info().reference == "required"
        out = engine.add_request(row.request("r", "a red car", 3, 4, guidance_scale=5.0)).result(timeout=120).images
    finally:
        engine.close()
    assert max_diff(out, bare_call(row, str(folder), "a red car", 3, 4, 5.0)) <= 1
