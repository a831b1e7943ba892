"""Part 2: the parallel code paths with every rank on the one device.

Two and four ranks share cuda:0 and run CFG, Ulysses, ring and TP (4 ranks: Ulysses 2 x ring 2, TP 2 x CFG 2) on
the tiny DiT and SD3 (request mode: two requests fused; step mode: two batched); each rank's images must equal one
rank's on the same device within 2 uint8. Then distributed layerwise offload (gpucheck.dlo): two ranks, each half
of the tiny SD's UNet, each its own request, equal to one rank within 1 uint8, with the memory each rank held. This
proves the collectives' device handling (tensors on CUDA, the
ring's host staging over gloo, the gathers), not a speedup: the ranks share one GPU.

The backend: NCCL is tried first on 2 ranks (it may refuse two ranks on one device); where it fails, every plan
runs over gloo with CUDA tensors, and the report says which worked and NCCL's answer. The dry run is gloo on CPU.
Tiny models in float32 by default: the comparison then shows the device handling, not half-precision rounding.
"""

from __future__ import annotations

from gpucheck import dlo
from gpucheck.ranks import PLANS_2, PLANS_4, TOLERANCE, errors, launch, load_adapter, parallel_config, scenario_images
from gpucheck.ranks import worst_diff

KINDS = ("dit", "sd3")


def job(plan: dict, models: dict, target, dtype: str, backend: str | None) -> dict:
    return {"plan": plan, "models": models, "placement": "cpu" if target.dry else "shared", "dtype": dtype,
            "backend": backend, "collective_timeout_s": 90.0}


def pick_backend(models: dict, references: dict, target, dtype: str, clock, emit) -> str:
    """NCCL when two ranks on the one device can use it (and give the right images); else gloo."""
    if target.dry:
        emit("backend", "info", "gloo", "cpu dry run: gloo on CPU processes (NCCL not tried)", backend="gloo")
        return "gloo"
    answers = launch(2, job(PLANS_2["cfg 2"], models, target, dtype, "nccl"), min(45.0, max(20.0, clock.left() / 3)))
    problems = errors(answers)
    if not problems and worst_diff(answers, references) <= TOLERANCE:
        emit("backend", "info", "nccl", "NCCL accepted two ranks on one device", backend="nccl")
        return "nccl"
    why = problems[0] if problems else f"images off by {worst_diff(answers, references)} uint8"
    emit("backend", "info", "gloo (CUDA tensors)", f"NCCL on one device: {why}", backend="gloo", nccl_error=why)
    return "gloo"


def run(target, clock, emit, root: str, dtype: str = "float32", plans: list[str] | tuple[str, ...] = ()) -> None:
    from stage_runtime.models.tiny import make_tiny_model

    models = {kind: str(make_tiny_model(f"{root}/parallel-{kind}", kind=kind)) for kind in KINDS}
    references = {kind: scenario_images(load_adapter(path, target.torch_device, dtype)) for kind, path in models.items()}
    target.free()
    every = {**PLANS_2, **PLANS_4}
    unknown = [p for p in plans if p not in every and p != "dlo"]
    if unknown:
        raise ValueError(f"plans={unknown}: expected some of {', '.join(every)}")
    backend = pick_backend(models, references, target, dtype, clock, emit)
    for name, plan in ((name, every[name]) for name in plans or every if name in every):
        world = parallel_config(plan).world_size
        check = f"{name} on {world} ranks, one {target.device} device"
        if clock.spent(need_s=10):
            emit(check, "budget", "", clock.reason(), plan=plan)
            continue
        answers = launch(world, job(plan, models, target, dtype, backend), max(20.0, min(90.0, clock.left())))
        problems = errors(answers)
        if problems:
            status = "budget" if all(s == "timeout" for s, _ in answers.values()) else "FAIL"
            emit(check, status, "no images", "; ".join(problems)[:400], plan=plan, backend=backend, errors=problems)
            continue
        diff = worst_diff(answers, references)
        emit(check, "ok" if diff <= TOLERANCE else "FAIL", f"max|diff| {diff} (<= {TOLERANCE})",
             f"{backend}, {dtype}, {len(KINDS)} models x 4 images per rank vs one rank", plan=plan, backend=backend,
             dtype=dtype, max_diff=diff, world=world)
    if not plans or "dlo" in plans:
        dlo.check(str(make_tiny_model(f"{root}/parallel-sd", kind="sd")), target, backend, clock, emit)
