"""LoRA adapters under CFG parallel and tensor parallel, in worker processes (the multiprocess executor, gloo).

CFG parallel gives each rank a contiguous chunk of every denoiser call's rows, so the per-row LoRA plan made for the
whole call follows the rank's rows (``PipelineAdapter.rows_on_this_rank``): requests with different adapter sets
in one tick may land on different ranks, or one request's unconditional and conditional rows may. Tensor parallel
shards the adapted layers: each rank holds B's rows of a column-parallel layer's outputs and A's columns of a
row-parallel layer's inputs, and the row-parallel delta joins the partial product before the layer's one
all_reduce. Each result equals diffusers' ``load_lora_weights`` + ``set_adapters`` of the same files on one process
within 2 uint8 (parallel), and a plain request in the same tick is the base model."""

from __future__ import annotations

import pytest
from engine_probes import max_diff
from family_checks import Family
from lora_probes import bare_with_loras, two_expert_file, write_adapter
from safetensors import safe_open

from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine
from stage_runtime.request import DiffusionRequest, SamplingParams

PROMPT, STEPS = "a photo of a cat", 3
GUIDANCE = {"sd": 7.5, "flux": 3.5, "zimage": 5.0}
SETS = {"base": (), "a": ({"name": "a", "scale": 0.8},), "b": ({"name": "b", "scale": 1.2},),
        "ab": ({"name": "a", "scale": 0.5}, {"name": "b", "scale": -0.4})}


def engine(path: str, adapters: dict[str, str], mode: str, parallel: dict) -> DiffusionEngine:
    config = load_config({"model": {"path": path}, "device": "cpu", "warmup": False, "executor": "mp",
                          "parallel": parallel, "loras": [{"name": n, "path": p} for n, p in adapters.items()],
                          "scheduler": {"execution_mode": mode, "max_num_seqs": 4,
                                        "request_batch_max_wait_ms": 300 if mode == "request" else 0}})
    return DiffusionEngine.make_engine(config)


def run_sets(eng: DiffusionEngine, kind: str, sets: dict) -> dict:
    """Every set's request admitted together (one tick in step mode, one fused call in request mode)."""
    with eng._lock:
        streams = {name: eng.add_request(DiffusionRequest(name, PROMPT, SamplingParams(
            num_inference_steps=STEPS, seed=i, height=64, width=64, guidance_scale=GUIDANCE[kind], loras=loras)))
            for i, (name, loras) in enumerate(sets.items())}
    return {name: s.result(timeout=300).images for name, s in streams.items()}


def reference(path: str, adapters: dict[str, str], kind: str, loras: tuple, seed: int):
    used = {ref["name"]: adapters[ref["name"]] for ref in loras}
    return bare_with_loras(path, used, [ref["scale"] for ref in loras] or None, PROMPT, STEPS, seed,
                           guidance_scale=GUIDANCE[kind])


@pytest.mark.parametrize(("kind", "mode"), [("sd", "step"), ("sd", "request"), ("zimage", "step")])
def test_cfg_parallel_ranks_apply_the_adapters_of_their_own_rows(kind, mode, tiny_model, tmp_path_factory):
    """SD: step mode puts base and a on rank 0, b and a+b on rank 1; request mode puts every unconditional row
    on rank 0 and every conditional row on rank 1. Z-Image: its rows are lists (distributed/cfg_parallel_lists)."""
    path, out = tiny_model(kind), tmp_path_factory.mktemp(f"cfg-lora-{kind}")
    gain = 0.3 if kind == "sd" else 1.0
    adapters = {n: write_adapter(path, out / n, seed=s, gain=gain) for n, s in (("a", 1), ("b", 2))}
    eng = engine(path, adapters, mode, {"cfg_parallel_size": 2})
    try:
        ours = run_sets(eng, kind, SETS)
    finally:
        eng.close()
    for i, (name, loras) in enumerate(SETS.items()):
        assert max_diff(ours[name], reference(path, adapters, kind, loras, i)) <= 2, name
    assert max_diff(ours["a"], ours["base"]) >= 3, "the adapter changed nothing"


def test_tensor_parallel_shards_the_factors_with_their_layers_at_startup_and_at_run_time(tiny_flux_path,
                                                                                        tmp_path_factory):
    """FLUX under TP 2: adapters on the column-parallel q/k/v, add_q_proj and proj_mlp and the row-parallel
    to_out; one loaded at startup, one at run time (collective_rpc), each rank holding half of the sharded factors."""
    out = tmp_path_factory.mktemp("tp-lora")
    adapters = {n: write_adapter(tiny_flux_path, out / n, seed=s, gain=1.0) for n, s in (("a", 1), ("b", 2))}
    eng = engine(tiny_flux_path, {"a": adapters["a"]}, "step", {"tensor_parallel_size": 2})
    try:
        eng.collective_rpc("load_lora", ("b", adapters["b"]))
        held = eng.rank_rpc("list_loras")
        ours = run_sets(eng, "flux", SETS)
    finally:
        eng.close()
    for i, (name, loras) in enumerate(SETS.items()):
        assert max_diff(ours[name], reference(tiny_flux_path, adapters, "flux", loras, i)) <= 2, name
    assert max_diff(ours["a"], ours["base"]) >= 3, "the adapter changed nothing"
    with safe_open(f"{adapters['a']}/pytorch_lora_weights.safetensors", framework="pt") as f:
        whole = sum(f.get_tensor(k).nbytes for k in f.keys())
    for rank in held:                      # (the CLIP encoder's factors are whole on every rank)
        a = next(s for s in rank if s["name"] == "a")
        assert a["modules"]["transformer"] > 0 and a["bytes"] < whole, f"{a['bytes']} bytes of {whole}: not sharded"


def test_cfg_parallel_on_wan22_routes_each_ranks_rows_to_their_expert_with_their_adapters(tiny_wan22_path,
                                                                                         tmp_path_factory):
    """Wan 2.2's two experts under CFG 2: a rank's chunk of the rows is routed to the experts, and each expert's
    LoRA plan is cut to the rows this rank runs (``RoutedDenoiser.local_rows``). One adapter adapts both experts
    (diffusers: the pair, the second loaded into transformer_2); a plain request shares the ticks."""
    out = tmp_path_factory.mktemp("cfg-lora-wan22")
    high = write_adapter(tiny_wan22_path, out / "high", seed=2, text_encoder=False, gain=3.0)
    low = write_adapter(tiny_wan22_path, out / "low", seed=3, text_encoder=False, gain=3.0, expert="transformer_2")
    wan = Family("wan22", size=16, frames=9)
    eng = engine(tiny_wan22_path, {"both": two_expert_file(high, low, out / "both")}, "step",
                 {"cfg_parallel_size": 2})
    try:
        with eng._lock:
            streams = {rid: eng.add_request(wan.request(rid, PROMPT, STEPS, seed, guidance_scale=5.0, loras=loras))
                       for rid, seed, loras in (("adapted", 11, [{"name": "both", "scale": 0.8}]), ("plain", 12, []))}
        ours = {rid: s.result(timeout=300).images for rid, s in streams.items()}
    finally:
        eng.close()
    video = {"size": 16, "num_frames": 9, "guidance_scale": 5.0}
    adapted = bare_with_loras(tiny_wan22_path, {"high": high, "low": low}, [0.8, 0.8], PROMPT, STEPS, 11,
                              into_transformer_2=("low",), **video)
    assert max_diff(ours["adapted"], adapted) <= 2
    assert max_diff(ours["plain"], bare_with_loras(tiny_wan22_path, {}, None, PROMPT, STEPS, 12, **video)) <= 2
    assert max_diff(ours["adapted"], bare_with_loras(tiny_wan22_path, {}, None, PROMPT, STEPS, 11, **video)) > 5

