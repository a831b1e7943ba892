"""Rank-side code of the ring, Ulysses × ring and tensor-parallel tests (spawned gloo ranks).

Reuses dist_rank_checks (spawn and reaping, adapter loading, the request/step scenarios, image comparison);
adds two jobs: ``models`` (apply the topology to each model, report what got installed and every scenario's
image) and ``kernels`` (the sequence-parallel attention of distributed.usp against plain SDPA, uneven chunks,
without and with a key mask).
"""

from __future__ import annotations

import dist_rank_checks as checks

TIMEOUT_S = 60.0


def installed(denoiser) -> dict:
    """CFG wrapper present; sequence-parallel attention processors and their ring size; TP row-parallel
    layers and the local head counts."""
    from stage_runtime.distributed.tensor_parallel import RowParallelLinear
    from stage_runtime.distributed.ulysses import UlyssesAttnProcessor
    from stage_runtime.models.families.hunyuan_video15 import HunyuanVideo15UlyssesAttnProcessor
    from stage_runtime.distributed.ulysses_joint import JointUlyssesProcessor
    from stage_runtime.models.families.qwen_image import QwenUlyssesAttnProcessor
    from stage_runtime.models.families.wan_ulysses import WanUlyssesAttnProcessor

    kinds = (UlyssesAttnProcessor, JointUlyssesProcessor, QwenUlyssesAttnProcessor, WanUlyssesAttnProcessor,
             HunyuanVideo15UlyssesAttnProcessor)
    sp = [m.processor for m in denoiser.modules() if isinstance(getattr(m, "processor", None), kinds)]
    return {"cfg": getattr(denoiser, "_diffstage_cfg_parallel", None) is not None,
            "sp": len(sp), "ring": sorted({p.mesh.ring_size for p in sp}),
            "ulysses": sorted({p.mesh.ulysses_size for p in sp}),
            "tp_row_layers": sum(isinstance(m, RowParallelLinear) for m in denoiser.modules()),
            "heads": sorted({m.heads for m in denoiser.modules() if hasattr(m, "processor") and hasattr(m, "heads")})}


def _job_models(rank, groups, parallel, run) -> dict:
    from stage_runtime.distributed.apply import apply_parallelism

    payload = {"coords": tuple(groups.coords)}
    for kind, path in run["models"].items():
        adapter = checks.load_adapter(path)
        apply_parallelism(adapter, groups, parallel)
        payload[f"{kind}-installed"] = installed(adapter.denoiser)
        payload[kind] = checks.scenarios(adapter)
        payload[f"{kind}-transformer"] = checks.transformer_outputs(adapter)
    return payload


def attention_case(seed: int = 0, tokens: int = 37):
    """Full (B, S, H, D) q, k, v with an odd token count (uneven chunks) and their exact attention."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, tokens, 4, 8, generator=gen) * 3 for _ in range(3))
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    return q, k, v, ref


def key_mask_case(q, k, v, seed: int = 1):
    """A key mask over the 37 tokens of :func:`attention_case` — batch row 0 masks its first 19 keys (the whole
    first block of ring 2 and of Ulysses 2 × ring 2), row 1 about a third at random — and the masked attention."""
    import torch
    import torch.nn.functional as F

    mask = torch.rand(2, q.shape[1], generator=torch.Generator().manual_seed(seed)) > 0.33
    mask[0, :19], mask[0, 19:], mask[1, -1] = False, True, True
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask[:, None, None, :])
    return mask, ref.transpose(1, 2)


def _job_kernels(rank, groups, parallel, run) -> dict:
    import torch

    from stage_runtime.distributed.comm import BYTES_SENT
    from stage_runtime.distributed.ulysses_joint import chunk_sizes
    from stage_runtime.distributed.usp import SequenceMesh

    mesh = SequenceMesh.from_groups(groups, parallel)
    q, k, v, ref = attention_case()
    mask, masked_ref = key_mask_case(q, k, v)
    counts = chunk_sizes(q.shape[1], mesh.sp_size)
    mine = [torch.tensor_split(t, mesh.sp_size, dim=1)[mesh.sp_rank] for t in (q, k, v, ref, masked_ref)]
    with torch.inference_mode():
        masked = mesh.attention(*mine[:3], counts, mask)
    BYTES_SENT.clear()
    with torch.inference_mode():
        out = mesh.attention(*mine[:3], counts)
    return {"sp_rank": mesh.sp_rank, "ring_rank": mesh.ring_rank, "counts": counts,
            "max_error": float((out - mine[3]).abs().max()), "bytes": dict(BYTES_SENT),
            "masked_error": float((masked - mine[4]).abs().max())}


JOBS = {"models": _job_models, "kernels": _job_kernels}


def spawn(world: int, plan: dict[str, dict], models: dict[str, str], timeout_s: float = 600):
    """Run ``plan`` (name → run) on ``world`` ranks while computing the single-rank references of ``models``
    here; returns ({name: {rank: payload}}, {kind: {scenario: image}, "<kind>-transformer": float outputs})."""
    ranks = checks.Ranks(world, [{"timeout_s": TIMEOUT_S, **run} for run in plan.values()],
                         jobs_module=__name__)
    try:
        references = {}
        for kind, path in models.items():
            adapter = checks.load_adapter(path)
            references[kind], references[f"{kind}-transformer"] = (checks.scenarios(adapter),
                                                                   checks.transformer_outputs(adapter))
    finally:
        payloads = ranks.wait(timeout_s=timeout_s)
    return {name: {rank: payloads[rank][i] for rank in payloads} for i, name in enumerate(plan)}, references
