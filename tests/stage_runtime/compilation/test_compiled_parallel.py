"""A compiled denoiser on 2 real gloo ranks: Ulysses (degree 2) on the trained tiny-digits DiT, regional. Each rank
compiles its own graphs, broken around every all_to_all (distributed/comm.py's helpers are not traced), and the
images of a step-batched load (1-3 images a request, CFG on and off) are within 2 (uint8) of one eager rank, with
no graph compiled after warm-up on either rank."""

from __future__ import annotations

import pytest
from engine_probes import max_diff
from support.compile_cache import shared_compile_cache

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.models.tiny.digits import FOLDER
from stage_runtime.request import DiffusionRequest, SamplingParams


def engine(**extra) -> DiffusionEngine:
    return DiffusionEngine.make_engine(load_config({
        "model": {"path": str(FOLDER)}, "device": "cpu", "collective_timeout_s": 300,
        "scheduler": {"execution_mode": "step", "max_num_seqs": 4}, **extra}))


def load(eng: DiffusionEngine) -> dict:
    streams = {f"r{i}": eng.add_request(DiffusionRequest(f"r{i}", str(i), SamplingParams(
        num_inference_steps=6 + i, seed=i, num_outputs=1 + i % 3, guidance_scale=1.0 if i == 3 else None)))
        for i in range(5)}
    return {rid: s.result(timeout=600).images for rid, s in streams.items()}


@pytest.fixture(scope="module")
def ulysses_compiled():
    eng = engine(executor="mp", parallel={"ulysses_degree": 2},
                 compile={"mode": "regional", "cache_dir": str(shared_compile_cache())})
    try:
        warmed = eng.compile_warmup_stats
        return warmed, load(eng), eng.collective_rpc("compile_stats")
    finally:
        eng.close()


def test_each_rank_compiles_and_nothing_after_warm_up(ulysses_compiled):
    warmed, _, after = ulysses_compiled
    assert [r["mode_effective"] for r in after] == ["regional", "regional"], after
    for before, now in zip(warmed, after, strict=True):
        assert now["graphs"] == before["graphs"] > 4 and now["recompiles"] == 0, (before, now)   # broken graphs


def test_images_are_within_2_of_one_eager_rank(ulysses_compiled):
    _, compiled, _ = ulysses_compiled
    eng = engine(executor="uni")
    try:
        eager = load(eng)
    finally:
        eng.close()
    for rid in eager:
        assert max_diff(compiled[rid], eager[rid]) <= 2, rid
