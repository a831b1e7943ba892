"""LTX2Pipeline (LTX-2, video with sound): its facts, the frame and size rules at admission, the audio denoised with
the video (its waveform equal to diffusers'), ``fps`` as diffusers' ``frame_rate``, spatio-temporal guidance in the
one forward per step, and image-to-video on the same model (``LTX2ImageToVideoPipeline`` over its components) next
to text-to-video in one forward (its ``FAMILIES`` rows, text- and image-to-video, run the checklist:
test_families.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, LTX2VideoTransformer3DModel
from engine_probes import assert_no_state, count_denoiser_calls, max_diff
from executors_for_tests import ComputeDoneFirst
from family_checks import Family, bare_call, bare_pipeline, generators, make_engine, to_uint8
from mp_probes import segments
from support.waiting import wait_until

from stage_runtime.config import ModelConfig, ParallelConfig, load_config
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.distributed.groups import single_rank_groups
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import ConfigError, InvalidRequestError
from stage_runtime.models.families.ltx2 import LTX2Adapter
from stage_runtime.models.registry import resolve_adapter_class

torch.set_num_threads(1)
FAMILIES = (Family("ltx2", guidances=(3.0, 5.0), size=64, frames=9),
            Family("ltx2", guidances=(3.0, 5.0), size=64, frames=9, reference=True,
                   pipeline_class="LTX2ImageToVideoPipeline", per_video=True, label="ltx2-i2v"))
FAMILY, I2V = FAMILIES
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def adapter(tiny_ltx2_path) -> LTX2Adapter:
    return resolve_adapter_class(ModelConfig(path=tiny_ltx2_path)).load(tiny_ltx2_path, CPU)


def run_alone(adapter: LTX2Adapter, request) -> tuple:
    """The request's step loop on the adapter alone → (uint8 frames, waveform, its state's passes)."""
    with torch.inference_mode():
        state = adapter.prepare_encode(request.resolve(adapter.info()))
        while not state.finished:
            adapter.noise_step(state, adapter.denoise_step([state])[0])
        return adapter.post_decode(state), adapter.decode_audio(state), state.passes


def test_facts(adapter):
    info = adapter.info()
    assert (info.pipeline_class, info.adapter) == ("LTX2Pipeline", "stage_runtime.models.families.ltx2:LTX2Adapter")
    assert info.video and info.frame_rule == (8, 1) and (info.default_frames, info.default_fps) == (121, 24)
    assert (info.default_height, info.default_width, info.size_multiple) == (512, 768, 32)
    assert (info.default_steps, info.default_guidance, info.max_sequence_length) == (30, 3.0, 1024)
    assert info.step_key == ("height", "width", "num_frames", "fps") and "fps" in info.request_key
    assert info.supports_step_execution and info.parallel_kinds == ("cfg",) and not info.takes_guidance_2
    assert info.reference == "optional"              # with a picture: image-to-video; without: text-to-video


def test_frames_off_8k_plus_1_sizes_off_32_and_a_one_pixel_picture_are_refused_at_admission(tiny_ltx2_path):
    """diffusers decodes (F - 1) // 8 x 8 + 1 frames for another count (10 → 9) and raises on a side off 32 and
    on a picture with a one-pixel side."""
    engine = make_engine(tiny_ltx2_path, warmup=False)
    try:
        with pytest.raises(InvalidRequestError, match=r"^num_frames=10: LTX2Pipeline takes 8k\+1 frames \(9, 17"):
            engine.add_request(FAMILY.request("r", "a cat", 2, 1, num_frames=10))
        for field in ("height", "width"):
            with pytest.raises(InvalidRequestError, match=rf"^{field}=80: must be a multiple of 32"):
                engine.add_request(FAMILY.request("r", "a cat", 2, 1, **{field: 80}))
            with pytest.raises(InvalidRequestError, match=rf"^{field}=32: LTX2Pipeline needs at least 64 \(two latent"):
                engine.add_request(FAMILY.request("r", "a cat", 2, 1, **{field: 32}))   # diffusers' VAE would raise
        thin = FAMILY.request("r", "a cat", 2, 1)
        thin.reference = np.zeros((1, 5, 3), np.uint8)             # diffusers' H.264 re-compression would raise
        with pytest.raises(InvalidRequestError, match=r"^input_reference='5x1': LTX2Pipeline needs a picture of at "
                                                      r"least 2x2 pixels"):
            engine.add_request(thin)
        negative = engine.add_request(FAMILY.request("n", "a cat", 2, 1, guidance_scale=1.0, negative_prompt="blur"))
        assert negative.result(timeout=120).images.shape == (1, 9, 64, 64, 3)       # audio CFG still uses it
        assert_no_state(engine)
    finally:
        engine.close()


def test_audio_is_denoised_with_the_video_and_decodes_to_diffusers_waveform(adapter, tiny_ltx2_path):
    """Two videos with a negative prompt: frames within 1 uint8 and the stereo waveform (audio VAE + vocoder) equal
    to the bare call's ``.audio``, as long as the clip (9 frames at 24 fps, 16 kHz: 5312 samples here)."""
    prompt, negative = "a dog barking in the rain", "silence"
    frames, audio, passes = run_alone(adapter, FAMILY.request("r", prompt, 3, 5, num_outputs=2, guidance_scale=4.0,
                                                              negative_prompt=negative))
    assert passes == ("uncond", "cond", "isolated")       # the tiny blocks do not perturb: no STG row (below)
    bare = bare_pipeline(tiny_ltx2_path)(prompt=[prompt] * 2, negative_prompt=[negative] * 2, guidance_scale=4.0,
                                         height=64, width=64, num_frames=9, num_inference_steps=3,
                                         generator=generators(5, 2), output_type="np")
    assert max_diff(frames, to_uint8(bare.frames)) <= 1
    assert audio.shape == bare.audio.shape == (2, 2, 5312) and bare.audio.abs().max() > 0.01
    torch.testing.assert_close(audio, bare.audio, rtol=0, atol=1e-5)


def test_the_sound_reaches_the_output_beside_frames_that_come_later_and_a_cached_repeat_keeps_it(tiny_ltx2_path):
    """Request mode on a worker process whose frames go through shared memory after COMPUTE_DONE (the sound rides
    inline on COMPUTE_DONE): the output's ``audio`` is the bare call's ``.audio`` within 1e-4, one track per video,
    at the vocoder's rate; an exact repeat answered by the result cache has the same sound; nothing is left."""
    config = load_config({"model": {"path": tiny_ltx2_path}, "device": "cpu", "executor": "mp", "warmup": False,
                          "cache": {"result_max_bytes": 1 << 24}})
    engine = DiffusionEngine.make_engine(config, executor_class=ComputeDoneFirst)
    try:
        first = engine.add_request(FAMILY.request("r", "waves on a beach", 2, 7, num_outputs=2)).result(timeout=300)
        again = engine.add_request(FAMILY.request("r2", "waves on a beach", 2, 7, num_outputs=2)).result(timeout=60)
        wait_until(lambda: engine.executor.num_pending() == 0, timeout=30)
        assert engine.num_request_states() == 0 and segments(engine.executor.shm_prefix) == []
    finally:
        engine.close()
    bare = bare_pipeline(tiny_ltx2_path)(prompt=["waves on a beach"] * 2, height=64, width=64, num_frames=9,
                                         num_inference_steps=2, generator=generators(7, 2), output_type="np")
    assert max_diff(first.images, to_uint8(bare.frames)) <= 1
    assert first.audio.sample_rate == 16000 and first.audio.samples.shape == (2, 2, 5312)
    np.testing.assert_allclose(first.audio.samples, bare.audio.float().numpy(), rtol=0, atol=1e-4)
    assert again.metrics.get("result_cache_hit") == 1 and np.array_equal(again.audio.samples, first.audio.samples)


def test_fps_is_the_frame_rate_diffusers_conditions_on(tiny_ltx2_path):
    """``fps`` moves the video's rotary positions and sets the audio length: 12 fps equals diffusers at
    ``frame_rate=12.0``, in request and step mode, and differs from the default 24."""
    outs = {}
    for mode in ("request", "step"):
        engine = make_engine(tiny_ltx2_path, mode, warmup=False)
        try:
            outs[mode] = engine.add_request(FAMILY.request("r", "a kite", 3, 7, fps=12)).result(timeout=60).images
        finally:
            engine.close()
    at_12 = bare_call(FAMILY, tiny_ltx2_path, "a kite", 3, 7, 3.0, frame_rate=12.0)
    assert max_diff(outs["request"], at_12) <= 1 and max_diff(outs["step"], at_12) <= 2
    assert max_diff(at_12, bare_call(FAMILY, tiny_ltx2_path, "a kite", 3, 7, 3.0)) > 20


def test_stg_rows_run_in_the_same_forward_where_a_block_perturbs(tiny_ltx2_path):
    """diffusers' STG pass replaces the self-attention of ``spatio_temporal_guidance_blocks`` by its values, in
    blocks built with ``perturbed_attn`` only; the tiny model has none (and 2 blocks, the default is [28]), so there
    the pass is the conditional one and no row runs for it. With perturbed attention and block 1 named, the
    perturbed rows join the one forward per step (a per-row mask) and the video equals diffusers' third pass."""
    def perturbing_pipe():
        transformer = LTX2VideoTransformer3DModel.from_pretrained(tiny_ltx2_path, subfolder="transformer",
                                                                  perturbed_attn=True)
        pipe = DiffusionPipeline.from_pretrained(tiny_ltx2_path, local_files_only=True, transformer=transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    adapter = LTX2Adapter(perturbing_pipe(), CPU)
    assert not adapter.rows.perturbs(adapter.defaults["spatio_temporal_guidance_blocks"])
    adapter.defaults["spatio_temporal_guidance_blocks"] = [1]            # what this test serves: block 1
    forwards = [0]
    adapter.denoiser.register_forward_pre_hook(lambda _m, _a: forwards.__setitem__(0, forwards[0] + 1))
    frames, _, passes = run_alone(adapter, FAMILY.request("r", "a lighthouse", 4, 2))
    assert passes == ("uncond", "cond", "perturbed", "isolated") and forwards[0] == 4
    bare = perturbing_pipe()
    kw = {"prompt": ["a lighthouse"], "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 4,
          "output_type": "np"}
    stg = to_uint8(bare(**kw, spatio_temporal_guidance_blocks=[1], generator=generators(2, 1)).frames)
    assert max_diff(frames, stg) <= 1
    assert max_diff(stg, to_uint8(bare(**kw, generator=generators(2, 1)).frames)) > 5    # STG changed it (14 here)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_text_and_image_to_video_share_each_forward_and_equal_their_own_pipelines(tiny_ltx2_path, mode):
    """One engine: a request with a picture runs LTX2ImageToVideoPipeline's computation, one without LTX2Pipeline's,
    in the same forwards (every row then gets a timestep per video token: 0 on the picture's first frame)."""
    engine = make_engine(tiny_ltx2_path, mode, warmup=False, max_num_seqs=2, request_batch_max_wait_ms=200)
    calls = count_denoiser_calls(engine)
    try:
        image = engine.add_request(I2V.request("i", "a kite", 3, 4))
        text = engine.add_request(FAMILY.request("t", "a kite", 3, 4))
        image_out, text_out = image.result(timeout=120).images, text.result(timeout=120).images
        assert calls[0] == 3, f"{calls[0]} forwards for two 3-step requests: they did not share"
        assert_no_state(engine)
    finally:
        engine.close()
    tolerance = 1 if mode == "request" else 2
    assert max_diff(image_out, bare_call(I2V, tiny_ltx2_path, "a kite", 3, 4, 3.0)) <= tolerance
    assert max_diff(text_out, bare_call(FAMILY, tiny_ltx2_path, "a kite", 3, 4, 3.0)) <= tolerance
    assert max_diff(image_out, text_out) > 20                  # the picture changed the video


def test_the_first_latent_frame_stays_the_pictures(adapter):
    """The picture's tokens get timestep 0 and the scheduler never moves them: the last latents' first frame is
    the encoded picture, bitwise; every other token was denoised."""
    request = I2V.request("r", "a kite", 3, 4, num_outputs=2).resolve(adapter.info())
    with torch.inference_mode():
        state = adapter.prepare_encode(request)
        first, start = state.cond["noisy"] == 0, state.latents.clone()
        assert first.sum() == 2 * 4 and first[:, :4].all()        # 2 videos x 2 x 2 latent pixels of frame 0
        while not state.finished:
            adapter.noise_step(state, adapter.denoise_step([state])[0])
    assert torch.equal(state.latents[first], start[first])
    assert (state.latents[~first] - start[~first]).abs().min() > 0


@pytest.fixture(scope="module")
def i2v_folder(tiny_ltx2_path, tmp_path_factory) -> str:
    """The tiny LTX-2's components saved as an LTX2ImageToVideoPipeline folder (its model_index names that class)."""
    out = tmp_path_factory.mktemp("models") / "tiny-ltx2-i2v"
    bare_pipeline(tiny_ltx2_path, "LTX2ImageToVideoPipeline").save_pretrained(out)
    return str(out)


def test_an_image_to_video_folder_is_served_by_the_same_adapter_and_needs_a_picture(i2v_folder, tiny_ltx2_path):
    engine = make_engine(i2v_folder, "step", warmup=False)
    try:
        info = engine.model_info
        assert (info.pipeline_class, info.adapter) == ("LTX2ImageToVideoPipeline",
                                                       "stage_runtime.models.families.ltx2:LTX2Adapter")
        assert info.reference == "required" and info.parallel_kinds == ("cfg",)
        with pytest.raises(InvalidRequestError, match=r"^input_reference=None: LTX2ImageToVideoPipeline makes a "
                                                      r"video from an image: give one"):
            engine.add_request(FAMILY.request("t", "a kite", 2, 4))
        out = engine.add_request(I2V.request("i", "a kite", 3, 4)).result(timeout=120).images
        assert_no_state(engine)
    finally:
        engine.close()
    assert max_diff(out, bare_call(I2V, tiny_ltx2_path, "a kite", 3, 4, 3.0)) <= 2


@pytest.mark.parametrize(("field", "why"), [("ulysses_degree", "no sequence-parallel installer fits LTX-2's two"),
                                            ("ring_degree", "no sequence-parallel installer fits LTX-2's two"),
                                            ("tensor_parallel_size", "not LTX2Attention")])
def test_sequence_and_tensor_parallel_are_refused_naming_the_family_and_the_degree(adapter, field, why):
    """CFG parallel runs (2 ranks equal one: distributed/test_families_parallel.py); the others exit 2 at load."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # tp without ulysses warns; not the point here
        parallel = ParallelConfig(**{field: 2})
    with pytest.raises(ConfigError, match=rf"^{field}=2 is not supported by LTX2Pipeline \(it runs: cfg\): .*{why}"):
        apply_parallelism(adapter, single_rank_groups(), parallel)
    assert getattr(adapter.denoiser, "_diffstage_cfg_parallel", None) is None
