"""Part 3's sleep arm (FLUX.1-sized; docs/sleep-and-profile.md): the real-size pipeline loaded by the model runner,
put to sleep at level 1 by the rank's own ``WeightSleeper`` (every module component to host memory, the allocator
cache emptied), then woken: the device memory the sleep gave back against the weights' bytes (the acceptance: at
least 0.9), and the wake's seconds. In the CPU dry run level 1 moves nothing (the weights already live in host
memory): the row says so, with the wake's seconds.
"""

from __future__ import annotations

SLEPT = ("flux",)


def sleep_arm(folder, spec, target, dtype, emit, config, build) -> None:
    from gpucheck.prebuilt import PIPES
    from gpucheck.target import gib
    from stage_runtime.worker.model_runner import DiffusionModelRunner
    from stage_runtime.worker.sleep import WeightSleeper

    check = f"{spec.name} sleep level 1, wake"
    PIPES[folder] = build(spec.name, target)
    runner = DiffusionModelRunner(config(folder, spec, target, "step", dtype), target.torch_device)
    try:
        runner.load_model()
        weights = sum(c["bytes"] for c in runner.weights.components.values())
        components = {n: m for n, m in runner.adapter.pipe.components.items() if hasattr(m, "parameters")}
        sleeper = WeightSleeper(target.torch_device, reload=dict, refusal=None)
        before = target.allocated_bytes()
        sleeper.sleep(components, 1)
        asleep = target.allocated_bytes()
        _, wake_s = target.timed(sleeper.wake, components)
    finally:
        runner.close()
        PIPES.pop(folder, None)
        target.free()
    if before is None:
        emit(check, "info", f"wake {wake_s:.3f} s", f"on the CPU level 1 moves nothing; weights {gib(weights)} "
             "[sleep]", model=spec.name, wake_s=wake_s, weight_bytes=weights)
        return
    freed = (before - asleep) / weights
    emit(check, "ok" if freed >= 0.9 else "FAIL", f"freed {freed:.2f}x the weights' bytes, wake {wake_s:.2f} s",
         f"device memory {gib(before)} -> {gib(asleep)} asleep; weights {gib(weights)} in {dtype}; "
         "the acceptance: at least 0.9 [sleep]", model=spec.name, freed_ratio=freed, wake_s=wake_s,
         weight_bytes=weights, allocated_before=before, allocated_asleep=asleep)
