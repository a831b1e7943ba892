"""Distributed layerwise offload (DLO) through the real engine on two gloo ranks: each rank holds half of the
denoiser, the ranks all-gather each block, and each computes its own request of a lock-step wave.

Every image equals the same request on one rank without DLO; a lone request (the warm-up's too) runs on both ranks,
one of them as padding; requests with different step counts run as separate waves and a mixed wave is refused whole
before any rank runs it; aborting one request of a wave leaves its rank computing (the collectives stay in step),
aborting all of them stops both ranks at the same step; nothing is left resident or in flight afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_probes import max_diff, wait_until
from lora_probes import bare_with_loras, write_adapter
from mp_probes import assert_released, req
from stage_runtime.config import load_config
from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.errors import RequestAbortedError
from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput
from stage_runtime.weight_layout import component_layout

LONG = 60            # steps: long enough that an abort lands mid-wave (the test waits for progress first)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return tmp_path_factory.mktemp("dlo") / "trace.jsonl"


@pytest.fixture(scope="module")
def dlo(tiny_sd_path, trace):
    """Two DLO ranks (tiny SD, the warm-up on): the trace file lists every pipeline call that returned images."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFSTAGE_TEST_TRACE", str(trace))          # inherited by the spawned ranks
        eng = DiffusionEngine.make_engine(load_config({
            "model": {"path": tiny_sd_path, "adapter": "adapters_for_tests:TracingSDAdapter"}, "device": "cpu",
            "parallel": {"num_gpus": 2}, "offload": {"mode": "distributed"}}))
    yield eng
    eng.close()
    assert_released(eng)


@pytest.fixture(scope="module")
def plain(tiny_sd_path):
    """The reference: one rank, no offload."""
    eng = DiffusionEngine.make_engine(load_config({"model": {"path": tiny_sd_path}, "device": "cpu",
                                                   "executor": "uni", "warmup": False}))
    yield lambda r: eng.add_request(r).result(120).images
    eng.close()


def calls(trace, since: int) -> list[dict]:
    return [json.loads(line) for line in trace.read_text().splitlines()[since:]]


def mark(trace) -> int:
    return len(trace.read_text().splitlines()) if trace.exists() else 0


def idle(eng) -> list[dict]:
    """Wait until nothing is in flight anywhere; every rank's offload stats then."""
    wait_until(lambda: eng.num_request_states() == 0 and eng.executor.num_pending() == 0, timeout=30)
    wait_until(lambda: eng.collective_rpc("num_request_states") == [0, 0], timeout=10)
    stats = eng.collective_rpc("offload_stats")
    for s in stats:
        assert s["units_resident"] == s["units_loading"] == 0 and s["resident_bytes"]["cpu"] == 0, s
    return stats


def blocker(eng, rid: str):
    """A running wave: requests added now wait, and the next wave takes them together."""
    stream = eng.add_request(req(rid, "a long one", 12, 9, stream=True))
    stream.get(timeout=60)
    return stream


def test_two_requests_one_wave_each_equal_one_rank_without_dlo(dlo, plain, trace, tiny_sd_path):
    a, b = req("a", "a red cat", 4, 1), req("b", "a blue dog", 4, 2)
    expected = {"a": plain(a), "b": plain(b)}
    first = blocker(dlo, "blocker")
    since = mark(trace)
    streams = [dlo.add_request(req("a", "a red cat", 4, 1)), dlo.add_request(req("b", "a blue dog", 4, 2))]
    assert first.result(60).ok
    for stream in streams:
        assert max_diff(stream.result(60).images, expected[stream.request_id]) <= 1
    wave = [c for c in calls(trace, since) if c["ids"] != ["blocker"]]
    assert sorted(c["ids"] for c in wave) == [["a"], ["b"]]                 # one request per rank
    assert len({c["pid"] for c in wave}) == 2
    first_call, second_call = sorted(wave, key=lambda c: c["start"])
    assert second_call["start"] < first_call["end"], "the two ranks did not compute the wave together"
    assert dlo.scheduler.max_num_running_reqs == 2                          # dp × max_num_seqs
    # at rest each rank holds half the denoiser (+ padding), nothing materialised, and the units cover all of it
    unet_bytes = dlo.weights[0]["components"]["unet"]["bytes"]
    layout = component_layout(Path(tiny_sd_path), "unet")
    for s in idle(dlo):
        assert s["managed_bytes"] == unet_bytes == layout.nbytes
        assert s["host_held_bytes"] == s["shard_bytes"] == layout.shard_bytes(2) <= 0.55 * unet_bytes
        assert s["gathers"] > 0 and s["world"] == 2


def test_a_lone_request_runs_on_every_rank_and_is_answered_once(dlo, plain, trace):
    since = mark(trace)
    result = dlo.add_request(req("solo", "a green tree", 3, 5)).result(60)
    assert max_diff(result.images, plain(req("solo", "a green tree", 3, 5))) <= 1
    ran = calls(trace, since)
    assert [c["ids"] for c in ran] == [["solo"], ["solo"]] and len({c["pid"] for c in ran}) == 2
    idle(dlo)


def test_different_step_counts_run_as_separate_waves(dlo, plain, trace):
    first = blocker(dlo, "blocker2")
    since = mark(trace)
    streams = [dlo.add_request(req("three", "a red cat", 3, 1)), dlo.add_request(req("five", "a red cat", 5, 1))]
    assert first.result(60).ok
    for stream, steps in zip(streams, (3, 5), strict=True):
        assert max_diff(stream.result(60).images, plain(req("x", "a red cat", steps, 1))) <= 1
    waves = [c for c in calls(trace, since) if c["ids"] != ["blocker2"]]
    assert sorted(c["ids"][0] for c in waves) == ["five", "five", "three", "three"]    # each alone, padded
    three_end = max(c["end"] for c in waves if c["ids"] == ["three"])
    assert min(c["start"] for c in waves if c["ids"] == ["five"]) >= three_end
    idle(dlo)


def test_the_executor_refuses_a_mixed_wave_before_any_rank_runs_it(dlo, trace):
    idle(dlo)
    since = mark(trace)
    mixed = SchedulerOutput(step_id=10**6, scheduled_new_reqs=[
        NewRequestData(r.request_id, r.resolve(dlo.model_info)) for r in (req("m3", steps=3), req("m5", steps=5))])
    out = dlo.executor.execute_model(mixed)
    for rid in ("m3", "m5"):
        assert out.get(rid).error.startswith("InvalidWave: a distributed-layerwise-offload wave must share one "
                                             "forward schedule"), out.get(rid).error
    assert calls(trace, since) == []
    assert dlo.add_request(req("after")).result(60).ok                     # the ranks are still in step
    idle(dlo)


def test_aborting_one_request_of_a_wave_keeps_the_ranks_in_step(dlo, plain, trace):
    first = blocker(dlo, "blocker3")
    since = mark(trace)
    doomed = dlo.add_request(req("doomed", "a red cat", LONG, 1, stream=True))
    kept = dlo.add_request(req("kept", "a blue dog", LONG, 2))
    assert first.result(60).ok
    doomed.get(timeout=60)                                                  # the wave is running
    assert dlo.abort("doomed") == ["doomed"]
    with pytest.raises(RequestAbortedError):
        doomed.result(60)
    assert max_diff(kept.result(120).images, plain(req("kept", "a blue dog", LONG, 2))) <= 1
    idle(dlo)
    ran = sorted(c["ids"][0] for c in calls(trace, since) if c["ids"] != ["blocker3"])
    assert ran == ["doomed", "kept"]              # the aborted request's rank computed on, its result dropped
    assert dlo.add_request(req("next", steps=2)).result(60).ok


def test_aborting_every_request_of_a_wave_stops_both_ranks(dlo, trace):
    first = blocker(dlo, "blocker4")
    since = mark(trace)
    streams = [dlo.add_request(req(rid, "a red cat", 400, 1, stream=True)) for rid in ("x1", "x2")]
    assert first.result(60).ok
    streams[0].get(timeout=60)
    assert sorted(dlo.abort(["x1", "x2"])) == ["x1", "x2"]
    for stream in streams:
        with pytest.raises(RequestAbortedError):
            stream.result(60)
    idle(dlo)
    assert [c for c in calls(trace, since) if c["ids"] != ["blocker4"]] == []      # neither call ran to its end
    assert dlo.add_request(req("again", steps=2)).result(60).ok
    idle(dlo)


def test_each_rank_applies_the_adapters_of_its_own_requests(dlo, tiny_sd_path, tmp_path):
    """LoRA under DLO: the factors are not sharded, only the base weights; adapters loaded at run time onto the
    released (sharded) model, and a wave whose two ranks run different adapter sets, each equal to diffusers'
    load_lora_weights + set_adapters of the same files."""
    adapters = {n: write_adapter(tiny_sd_path, tmp_path / n, seed=s, gain=0.3) for n, s in (("a", 1), ("b", 2))}
    for name, path in adapters.items():
        dlo.collective_rpc("load_lora", (name, path))
    sets = {"with-a": ({"name": "a", "scale": 1.0},),
            "with-ab": ({"name": "a", "scale": 0.6}, {"name": "b", "scale": -0.5})}
    try:
        first = blocker(dlo, "blocker5")
        streams = {rid: dlo.add_request(req(rid, "a red cat", 3, i, guidance_scale=7.5, loras=loras))
                   for i, (rid, loras) in enumerate(sets.items())}
        assert first.result(60).ok
        got = {rid: stream.result(60).images for rid, stream in streams.items()}
    finally:
        for name in adapters:
            dlo.collective_rpc("unload_lora", (name,))
    for i, (rid, loras) in enumerate(sets.items()):
        used = {ref["name"]: adapters[ref["name"]] for ref in loras}
        expected = bare_with_loras(tiny_sd_path, used, [ref["scale"] for ref in loras], "a red cat", 3, i,
                                   guidance_scale=7.5)
        assert max_diff(got[rid], expected) <= 1, rid
    idle(dlo)
