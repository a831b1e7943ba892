"""Rank-side code of the MMDiT (SD3, FLUX) parallel tests: CFG-parallel and joint Ulysses on real gloo ranks.

Reuses dist_rank_checks (adapter loading, the request/step scenarios, image comparison); adds the job that
also checks the joint Ulysses processors, and its own spawn (a spawned child imports this module by name).
``replaced_processor_error`` and ``models_job`` serve every family whose sequence-parallel processors keep the
processor they replace as ``.original`` (FLUX.2's too: flux2_rank_checks).
"""

from __future__ import annotations

import dist_rank_checks as checks


def installed(denoiser) -> dict:
    """CFG forward wrapper present; how many attentions run the joint Ulysses processor."""
    from stage_runtime.distributed.ulysses_joint import JointUlyssesProcessor

    return {"cfg": getattr(denoiser, "_diffstage_cfg_parallel", None) is not None,
            "ulysses": sum(isinstance(getattr(m, "processor", None), JointUlyssesProcessor)
                           for m in denoiser.modules())}


def replaced_processor_error(adapter, attn) -> str | None:
    """Put ``attn``'s original processor back: the next denoiser call must refuse to run."""
    import torch

    attn.set_processor(attn.processor.original)
    try:
        with torch.inference_mode():
            checks.run_steps(adapter, [checks._request(adapter, "r", "1", 1, 0, 1.0)])
    except RuntimeError as exc:
        return str(exc)
    return None


def models_job(installed, attention, outputs=None):
    """The ``models`` job of a family's parallel test: per model, what ``installed(denoiser)`` finds, the scenarios'
    images and hook calls, ``outputs(adapter)`` (the transformer called directly) when given and, under sequence
    parallelism, the refusal once ``attention(denoiser)``'s original processor is back."""
    def job(rank, groups, parallel, run) -> dict:
        from stage_runtime.distributed.apply import apply_parallelism

        payload = {}
        for kind, path in run["models"].items():
            adapter = checks.load_adapter(path)
            apply_parallelism(adapter, groups, parallel)
            payload[f"{kind}-installed"] = installed(adapter.denoiser)
            payload[kind], payload[f"{kind}-hook-calls"] = checks.counting_denoiser_hooks(adapter, checks.scenarios)
            if outputs is not None:
                payload[f"{kind}-transformer"] = outputs(adapter)
            if parallel.ulysses_degree > 1 or parallel.ring_degree > 1:
                payload[f"{kind}-replaced"] = replaced_processor_error(adapter, attention(adapter.denoiser))
        return payload

    return job


JOBS = {"models": models_job(installed, lambda denoiser: denoiser.transformer_blocks[0].attn)}


def Ranks(world: int, runs: list[dict]) -> checks.Ranks:  # noqa: N802 - a constructor, as dist_rank_checks.Ranks
    """``world`` spawned ranks running this module's :func:`job` for every run (spawn and reaping are shared)."""
    return checks.Ranks(world, [{**run, "job": "models"} for run in runs], jobs_module=__name__)
