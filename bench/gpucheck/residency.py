"""Part 1: weights and request state moved off the device come back bitwise.

- Offload: model and layerwise offload of a tiny SDXL (UNet blocks) and a tiny FLUX.1 (transformer blocks; the
  dry run: FLUX.1 only, and SD only for the preemption), each
  to the host-memory tier (``cuda <-> cpu``: pinned host masters) and to the disk tier (safetensors, memory-mapped;
  the runner picks it only off CUDA, so the check wires it in), in request and step mode: bitwise equal to the
  same runner without offload.
- Preemption: a long step-mode request preempted at step 4 by a higher-priority one has its step state copied to
  host memory (``scheduler.preempted_offload_max_bytes``), resumes, and ends bitwise equal to its uninterrupted run.
"""

from __future__ import annotations

import numpy as np

from gpucheck.families import CALLS, make_runner, request, runner_images

OFFLOAD_KINDS = ("sdxl", "flux")
PREEMPT_KINDS = ("sd", "flux")
ARMS = (("model", "cpu"), ("model", "disk"), ("layerwise", "cpu"), ("layerwise", "disk"))


def tier(name: str, target):
    from stage_runtime.offload.tiers import DiskTier, HostTier

    return HostTier(target.torch_device) if name == "cpu" else DiskTier()


def attach_offloader(runner, target, mode: str, tier_name: str):
    """Hand the loaded runner's weights to an offloader on the chosen tier (the runner's own pick is by device:
    host memory on CUDA, disk elsewhere); the runner releases and closes it as it would its own."""
    from stage_runtime.config import OffloadConfig
    from stage_runtime.offload.offloader import Offloader

    adapter = runner.adapter
    runner.offloader = Offloader(OffloadConfig(mode=mode), adapter.pipe, tuple(adapter.block_holders().values()),
                                 target.torch_device, tier=tier(tier_name, target), block_lists=adapter.block_lists)
    return runner


def images(runner, kind: str) -> dict[str, np.ndarray]:
    call = CALLS[kind]
    return {mode: runner_images(runner, request(call, f"{kind}-{mode}", seed=5, steps=4), mode)
            for mode in ("request", "step")}


def check_offload(kind: str, path: str, target, dtype: str, clock, emit) -> None:
    plain = make_runner(path, target, dtype)
    try:
        reference = images(plain, kind)
    finally:
        plain.close()
    for mode, tier_name in ARMS:
        check = f"offload {kind} {dtype} {mode} -> {tier_name} tier"
        if clock.spent():
            emit(check, "budget", "", clock.reason())
            continue
        runner = attach_offloader(make_runner(path, target, dtype), target, mode, tier_name)
        try:
            got = images(runner, kind)
            stats = runner.offload_stats()
        finally:
            runner.close()
            target.free()
        equal = all(np.array_equal(got[m], reference[m]) for m in reference)
        worst = max(int(np.abs(got[m].astype(np.int16) - reference[m].astype(np.int16)).max()) for m in reference)
        emit(check, "ok" if equal else "FAIL", "bitwise equal" if equal else f"max|diff| {worst} (want bitwise)",
             f"tier {stats['tier']}, {stats['units']} units, {stats['loads']} loads, peak resident "
             f"{stats['peak_resident_bytes'] / 2**20:.2f} of {stats['managed_bytes'] / 2**20:.2f} MiB",
             kind=kind, dtype=dtype, mode=mode, tier=stats["tier"], bitwise=equal, max_diff=worst,
             loads=stats["loads"], peak_resident_bytes=stats["peak_resident_bytes"],
             managed_bytes=stats["managed_bytes"])


def threadless_engine(path: str, target, dtype: str, **scheduler):
    """An engine without its loop thread: each ``step()`` is one tick (the preemption lands at an exact step)."""
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine

    return DiffusionEngine(load_config({"model": {"path": path, "dtype": dtype}, "device": target.device,
                                        "warmup": False, "scheduler": {"execution_mode": "step", "max_num_seqs": 1,
                                                                       **scheduler}}))


def check_preemption(kind: str, path: str, target, dtype: str, emit) -> None:
    call = CALLS[kind]
    engine = threadless_engine(path, target, dtype, scheduling_policy="priority", max_preemptions=3,
                               preempted_offload_max_bytes=1 << 30)
    try:
        runner = engine.executor.worker.model_runner
        solo = engine.add_request(request(call, "solo", seed=7, steps=8))
        while not solo.finished:
            engine.step()
        alone = solo.result(timeout=0).images
        long = engine.add_request(request(call, "long", seed=7, steps=8))
        for _ in range(4):
            engine.step()
        short = engine.add_request(request(call, "high", seed=3, steps=2, priority=10))
        engine.step()                                            # the boundary: long preempted, high's first step
        parked, state = runner.parked_bytes(), runner.step_states["long"]
        held = [state.latents, *(t for t in state.cond.values() if hasattr(t, "device"))]
        on_host = parked > 0 and all(t.device.type == "cpu" for t in held)
        while not long.finished:
            engine.step()
        out = long.result(timeout=0)
        short.result(timeout=0)
        equal = bool(np.array_equal(out.images, alone))
        ok = equal and parked > 0 and on_host and out.metrics.get("preemptions") == 1
        emit(f"preempt {kind} {dtype} -> host, resume", "ok" if ok else "FAIL",
             "bitwise equal" if equal else "differs from the uninterrupted run",
             f"{parked / 2**10:.1f} KiB of step state parked on the host (tensors there: {on_host}), "
             f"preemptions {out.metrics.get('preemptions')}", kind=kind, dtype=dtype, bitwise=equal,
             parked_bytes=parked, on_host=on_host)
    finally:
        engine.close()
        target.free()


def run(target, clock, emit, root: str) -> None:
    from stage_runtime.models.tiny import make_tiny_model

    dtype = target.dtypes[0]
    offload_kinds, preempt_kinds = (OFFLOAD_KINDS[1:], PREEMPT_KINDS[:1]) if target.dry else (OFFLOAD_KINDS,
                                                                                            PREEMPT_KINDS)
    for kind in offload_kinds:
        if clock.spent():
            emit(f"offload {kind}", "budget", "", clock.reason())
            continue
        try:
            check_offload(kind, str(make_tiny_model(f"{root}/offload-{kind}", kind=kind)), target, dtype, clock, emit)
        except Exception as exc:  # noqa: BLE001 - reported as a row; the other checks still run
            emit(f"offload {kind} {dtype}", "error", "", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
    for kind in preempt_kinds:
        if clock.spent():
            emit(f"preempt {kind}", "budget", "", clock.reason())
            continue
        try:
            check_preemption(kind, str(make_tiny_model(f"{root}/preempt-{kind}", kind=kind)), target, dtype, emit)
        except Exception as exc:  # noqa: BLE001 - reported as a row
            emit(f"preempt {kind} {dtype}", "error", "", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
