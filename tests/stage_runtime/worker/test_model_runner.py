"""DiffusionModelRunner driven directly (no engine): progress per denoising step, cancellation through the
progress hook, per-request errors inside a fused batch, outputs keyed by request id."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stage_runtime.config import load_config
from stage_runtime.outputs import ProgressEvent
from stage_runtime.request import DiffusionRequest, SamplingParams
from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput
from stage_runtime.worker.model_runner import DiffusionModelRunner


def make_runner(path: str) -> DiffusionModelRunner:
    runner = DiffusionModelRunner(load_config({"model": {"path": path}, "device": "cpu"}), torch.device("cpu"),
                                  progress_hook=None)
    runner.load_model()
    return runner


@pytest.fixture(scope="module")
def sd_runner(tiny_sd_path):
    runner = make_runner(tiny_sd_path)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def dit_runner(tiny_dit_path):
    runner = make_runner(tiny_dit_path)
    yield runner
    runner.close()


@pytest.fixture
def runner(sd_runner):
    sd_runner.progress_hook = None
    yield sd_runner
    sd_runner.progress_hook = None


def req(rid: str, prompt: str = "a cat", steps: int = 3, seed: int = 1, **kw) -> DiffusionRequest:
    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, **kw))


def wave(runner: DiffusionModelRunner, *requests: DiffusionRequest, step_id: int = 1) -> SchedulerOutput:
    return SchedulerOutput(step_id=step_id, scheduled_new_reqs=[
        NewRequestData(r.request_id, r.resolve(runner.model_info)) for r in requests])


class Recorder:
    """A progress hook that records every event and cancels ``cancel`` from step ``at`` on."""

    def __init__(self, runner: DiffusionModelRunner, cancel: set[str] = frozenset(), at: int = 0):
        self.runner, self.cancel, self.at = runner, set(cancel), at
        self.events: list[ProgressEvent] = []
        self.states_seen: list[int] = []

    def __call__(self, event: ProgressEvent):
        self.events.append(event)
        self.states_seen.append(self.runner.num_request_states())
        return self.cancel if event.step_index >= self.at else set()


def denoising(hook: Recorder) -> list[ProgressEvent]:
    """The denoising-step events (the encode and decode notices left out)."""
    return [e for e in hook.events if e.phase == "denoise"]


def test_progress_events_say_encode_then_one_per_step_then_decode(runner):
    hook = runner.progress_hook = Recorder(runner)
    out = runner.execute_model(wave(runner, req("a", seed=1), req("b", "a dog", seed=2)))
    assert [(e.phase, e.step_index) for e in hook.events] == [
        ("encode", 0), ("denoise", 0), ("denoise", 1), ("denoise", 2), ("decode", 3)]
    assert all(e.request_ids == ("a", "b") and e.num_steps == 3 for e in hook.events)
    assert hook.states_seen == [2] * 5                   # the runner holds the call's requests while running
    assert runner.num_request_states() == 0              # ... and nothing between calls
    assert set(out.outputs) == {"a", "b"}
    for rid in ("a", "b"):
        o = out.get(rid)
        assert o.request_id == rid and not o.aborted and o.error is None and o.finished
        assert o.images.shape == (1, 64, 64, 3) and o.images.dtype == np.uint8
        assert o.step_index == 3


def test_outputs_are_keyed_by_request_id(runner):
    out = runner.execute_model(wave(runner, req("two", seed=5, num_outputs=2), req("one", seed=6)))
    assert set(out.outputs) == {"two", "one"}
    assert all(o.request_id == rid for rid, o in out.outputs.items())
    assert out.get("two").images.shape == (2, 64, 64, 3)
    assert out.get("one").images.shape == (1, 64, 64, 3)
    assert out.get("missing") is None
    # The same request in the other position of the wave gets (nearly) the same image.
    swapped = runner.execute_model(wave(runner, req("one", seed=6), req("two", seed=5, num_outputs=2)))
    for rid in ("one", "two"):
        diff = np.abs(swapped.get(rid).images.astype(int) - out.get(rid).images.astype(int)).max()
        assert diff <= 2, f"{rid} differs by {diff} when its position in the wave changes"


def test_cancel_one_of_two_mid_call(runner):
    hook = runner.progress_hook = Recorder(runner, cancel={"b"}, at=1)
    out = runner.execute_model(wave(runner, req("a", seed=1), req("b", "a dog", seed=2)))
    assert len(denoising(hook)) == 3                     # the mate keeps the call running to the end
    assert hook.events[-1].phase == "decode" and hook.events[-1].request_ids == ("a",)   # b no longer
    b, a = out.get("b"), out.get("a")
    assert b.aborted and b.images is None and b.error is None
    assert not a.aborted and a.error is None and a.images.shape == (1, 64, 64, 3)
    assert runner.num_request_states() == 0
    runner.progress_hook = None
    alone = runner.execute_model(wave(runner, req("a", seed=1))).get("a")
    assert np.abs(alone.images.astype(int) - a.images.astype(int)).max() <= 2


def test_cancel_every_request_interrupts_the_call(runner):
    hook = runner.progress_hook = Recorder(runner, cancel={"a", "b"}, at=1)
    out = runner.execute_model(wave(runner, req("a", steps=50, seed=1), req("b", "a dog", steps=50, seed=2)))
    assert [e.step_index for e in denoising(hook)] == [0, 1]      # stopped at the next step, not after 50
    assert [e.phase for e in hook.events] == ["encode", "denoise", "denoise"]   # never decoded
    assert set(out.outputs) == {"a", "b"}
    for o in out.outputs.values():
        assert o.aborted and o.images is None and o.error is None
        assert o.step_index == 1
    assert runner.num_request_states() == 0
    runner.progress_hook = None
    assert runner.execute_model(wave(runner, req("after", steps=2))).get("after").images is not None


def test_cancel_ids_outside_the_call_are_ignored(runner):
    hook = runner.progress_hook = Recorder(runner, cancel={"someone-else"}, at=0)
    out = runner.execute_model(wave(runner, req("a", steps=2)))
    assert len(denoising(hook)) == 2 and not out.get("a").aborted and out.get("a").images is not None


def test_empty_wave(runner):
    assert runner.execute_model(SchedulerOutput(step_id=1)).outputs == {}
    assert runner.num_request_states() == 0


def test_a_request_that_skipped_admission_is_an_internal_error_that_fails_alone(dit_runner):
    # The engine refuses an out-of-range class at admission (a 400); on the rank the family's check is only an
    # assertion: a request that got past it unchecked fails alone as an internal error, its batch-mate runs.
    out = dit_runner.execute_model(wave(dit_runner, req("bad", "5000", steps=2), req("good", "207", steps=2)))
    assert set(out.outputs) == {"bad", "good"}
    bad, good = out.get("bad"), out.get("good")
    assert bad.error.startswith("RuntimeError: internal error: request 'bad' reached the rank without the family's "
                                "admission check (prompt='5000': class id must be < 1000") and bad.images is None
    assert not bad.aborted
    assert good.error is None and good.images.shape == (1, 64, 64, 3)
    assert dit_runner.num_request_states() == 0


def test_dit_non_ascii_digit_prompt_never_fails_its_batch_mate(dit_runner):
    # "²".isdigit() is True but int("²") raises ValueError: the prompt must either map to a class or fail
    # alone; it must never make execute_model_batch raise (which would fail the whole wave).
    out = dit_runner.execute_model(wave(dit_runner, req("odd", "²", steps=2), req("good", "207", steps=2)))
    assert set(out.outputs) == {"odd", "good"}
    odd, good = out.get("odd"), out.get("good")
    assert (odd.error is None) != (odd.images is None)
    assert good.error is None and good.images.shape == (1, 64, 64, 3)
