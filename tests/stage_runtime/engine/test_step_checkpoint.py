"""Step checkpoints: a running request's step state written between ticks (the ``checkpoint_request`` control RPC),
and a request carrying ``resume_from`` that continues from it to the very frames of the uninterrupted run — the tiny
Wan 2.2 (two experts, UniPC's multistep state) on another engine, as a replica that takes a job over; SD (DDIM, its
generator in the step's kwargs) on the same one; a request's denoised state saved before its decode, and a resume
from it that only decodes. Threadless engines: each ``step()`` is one tick. A checkpoint of another model, another
shape or another request is refused at admission naming ``resume_from``."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from engine_probes import assert_nothing_left, count_denoiser_calls, progress_of, threadless
from family_checks import Family

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.errors import InvalidRequestError

WAN22 = Family("wan22", size=16, frames=9)
WAN = Family("wan", size=16, frames=9)
SD = Family("sd")
STEPS, AT = 8, 3


def run_to_end(engine, stream):
    while not stream.finished:
        assert engine.step()
    return stream.result(timeout=0)


def checkpointed(engine, family: Family, path: str, prompt: str = "a red car", at: int = AT):
    """The request run alone to its end, its state written to ``path`` after ``at`` ticks: its final output."""
    stream = engine.add_request(family.request("A", prompt, STEPS, 7))
    for _ in range(at):
        engine.step()
    [saved] = engine.collective_rpc("checkpoint_request", ("A", path))
    assert (saved["path"], saved["step"], saved["total_steps"]) == (path, at, STEPS)
    assert saved["bytes"] == os.path.getsize(path) and saved["seconds"] >= 0
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]        # the temp file renamed, none left
    return run_to_end(engine, stream)


def resumed(family: Family, rid: str, path: str, prompt: str = "a red car", **fields):
    return dataclasses.replace(family.request(rid, prompt, STEPS, 7, stream=True, **fields), resume_from=path)


@pytest.fixture(scope="module")
def wan22_saved(tiny_wan22_path, tmp_path_factory):
    """(checkpoint path, the uninterrupted video) of the Wan 2.2 request, checkpointed at step AT."""
    path = str(tmp_path_factory.mktemp("ckpt") / "wan22.safetensors")
    engine = threadless(tiny_wan22_path)
    try:
        return path, checkpointed(engine, WAN22, path).images
    finally:
        engine.close()


@pytest.fixture(scope="module")
def wan22(tiny_wan22_path):
    engine = threadless(tiny_wan22_path)
    yield engine
    engine.close()


def test_a_video_resumed_on_another_engine_continues_at_its_step_to_the_same_frames(wan22, wan22_saved):
    path, uninterrupted = wan22_saved
    calls = count_denoiser_calls(wan22)
    stream = wan22.add_request(resumed(WAN22, "B", path))
    while not stream.finished:
        assert wan22.step()
    items = list(stream)
    out = items[-1]
    assert out.ok and out.step_index == STEPS and calls[0] == STEPS - AT       # the saved steps are not recomputed
    assert progress_of(items) == [("encode", AT), *(("denoise", k) for k in range(AT + 1, STEPS)), ("decode", STEPS)]
    assert np.array_equal(out.images, uninterrupted)                            # bitwise
    assert_nothing_left(wan22)


def test_a_request_saves_its_denoised_state_before_decoding_and_a_resume_from_it_only_decodes(wan22, wan22_saved,
                                                                                             tmp_path):
    _, uninterrupted = wan22_saved
    path = str(tmp_path / "denoised.safetensors")
    request = dataclasses.replace(WAN22.request("D", "a red car", STEPS, 7), save_denoised_to=path)
    assert np.array_equal(run_to_end(wan22, wan22.add_request(request)).images, uninterrupted)
    assert os.listdir(tmp_path) == ["denoised.safetensors"]
    calls = count_denoiser_calls(wan22)
    out = run_to_end(wan22, wan22.add_request(resumed(WAN22, "E", path)))
    assert out.step_index == STEPS and calls[0] == 0 and np.array_equal(out.images, uninterrupted)   # decode only
    assert_nothing_left(wan22)


def test_an_image_request_resumes_to_the_same_image_on_the_same_engine(tiny_sd_path, tmp_path):
    engine = threadless(tiny_sd_path)
    try:
        path = str(tmp_path / "sd.safetensors")
        uninterrupted = checkpointed(engine, SD, path, at=2).images
        out = run_to_end(engine, engine.add_request(resumed(SD, "B", path)))
        assert out.ok and np.array_equal(out.images, uninterrupted)
        assert engine.collective_rpc("checkpoint_request", ("gone", path)) == [None]     # no state: nothing written
        missing = str(tmp_path / "no-such-folder" / "x.safetensors")
        engine.add_request(SD.request("C", "a cat", STEPS, 1))
        engine.step()
        [failed] = engine.collective_rpc("checkpoint_request", ("C", missing))
        assert "C" in failed["error"] and missing in failed["error"]
        assert sorted(os.listdir(tmp_path)) == ["sd.safetensors"]
    finally:
        engine.close()


def test_a_video_with_the_block_cache_resumes_with_its_residuals(tiny_wan_path, tmp_path):
    """The block cache's state (per expert and CFG half: tuple-keyed residuals, its counters) is in the checkpoint:
    the resumed run skips the same steps and makes the same frames."""
    engine = DiffusionEngine(load_config({"model": {"path": tiny_wan_path}, "device": "cpu", "warmup": False,
                                          "scheduler": {"execution_mode": "step", "max_num_seqs": 1},
                                          "cache": {"mode": "block", "threshold": 0.3}}))
    try:
        path = str(tmp_path / "cached.safetensors")
        full = checkpointed(engine, WAN, path, at=4)
        out = run_to_end(engine, engine.add_request(resumed(WAN, "B", path)))
        assert full.metrics["steps_skipped"] > 0 and out.metrics["steps_skipped"] == full.metrics["steps_skipped"]
        assert np.array_equal(out.images, full.images)
    finally:
        engine.close()


@pytest.mark.parametrize(("fields", "named"), [
    ({"num_frames": 5}, "num_frames=9"),
    ({"height": 32, "width": 32}, "height=16"),
    ({"seed": 8}, "seed=7"),
    ({"prompt": "a blue car"}, "prompt='a red car'"),
], ids=["frames", "size", "seed", "prompt"])
def test_a_checkpoint_of_another_request_is_refused_naming_resume_from(wan22, wan22_saved, fields, named):
    path, _ = wan22_saved
    prompt = fields.pop("prompt", "a red car")
    request = dataclasses.replace(WAN22.request("X", prompt, STEPS, fields.pop("seed", 7), **fields), resume_from=path)
    with pytest.raises(InvalidRequestError) as refused:
        wan22.add_request(request)
    assert refused.value.field == "resume_from" and named in str(refused.value)
    assert wan22.requests_snapshot() == []


def test_a_checkpoint_of_another_model_or_no_checkpoint_is_refused_naming_resume_from(tiny_wan_path, wan22_saved,
                                                                                    tmp_path):
    path, _ = wan22_saved
    engine = threadless(tiny_wan_path)
    try:
        with pytest.raises(InvalidRequestError, match="written by another model") as refused:
            engine.check_request(resumed(WAN22, "X", path))
        assert refused.value.field == "resume_from"
        junk = tmp_path / "junk.safetensors"
        junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
        for where, why in ((str(junk), "not a step checkpoint"), (str(tmp_path / "none"), "no such checkpoint")):
            with pytest.raises(InvalidRequestError, match=why) as refused:
                engine.check_request(resumed(WAN22, "X", where))
            assert refused.value.field == "resume_from"
    finally:
        engine.close()
    request_mode = threadless(tiny_wan_path, mode="request")
    try:
        with pytest.raises(InvalidRequestError, match="execution_mode=step"):
            request_mode.check_request(resumed(WAN22, "X", path))
    finally:
        request_mode.close()
