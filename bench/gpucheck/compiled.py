"""Part 3's compile arm (FLUX.1-sized and Wan-2.1-1.3B-sized; docs/compile.md): the real-size denoiser compiled
``regional`` on the device, measured against the eager ticks of the same pipeline.

1. cold: a runner with ``compile: {mode: regional}`` on an empty cache folder; the warm-up is one tick of 1 request
   and one of 2 (a graph for 1 row and one for 2+), then ``compile_warmed``: the seconds spent compiling, the graphs;
2. the step tick of 1, 2 and 4 requests against the eager tick of the same batch, then the recompiles those
   ticks caused after warm-up (0: the batch dimension is dynamic);
3. warm: dynamo's in-memory state reset, a new runner on the same folder: its warm-up's compile seconds and whether
   every graph came from the cache (``hit``).

The runner's ``close`` gives the pipeline its eager forwards back, so the arms after this one run unchanged.
"""

from __future__ import annotations

import statistics

COMPILED = ("flux", "wan")          # the models the issue names: FLUX.1-size and Wan-1.3B-size


def compile_arm(folder, spec, shape, target, dtype, args, eager: dict[int, float], emit, root: str, config,
                tick_times) -> None:
    import torch._dynamo

    from stage_runtime.worker.model_runner import DiffusionModelRunner

    cache = f"{root}/compile-cache-{spec.name}"
    results = {}
    for phase in ("cold", "warm"):
        torch._dynamo.reset()                    # the warm run finds nothing in memory: only the folder
        runner = DiffusionModelRunner(config(folder, spec, target, "step", dtype,
                                             compile={"mode": "regional", "cache_dir": cache}), target.torch_device)
        try:
            runner.load_model()
            runner.compile_warmup()
            for batch in (1, 2):
                tick_times(runner, spec, shape, target, batch, 1, f"warm-{phase}-{batch}-")
            results[phase] = runner.compile_warmed()
            if phase == "cold":
                per = {batch: tick_times(runner, spec, shape, target, batch, args.ticks, f"c{batch}-")
                       for batch in eager}
                after = runner.compile_stats()
        finally:
            runner.close()
            target.free()
    cold, warm = results["cold"], results["warm"]
    emit(f"{spec.name} compile regional, cold", "info" if cold["mode_effective"] == "regional" else "FAIL",
         f"{cold['cold_compile_s']:.1f} s", f"{cold['graphs']} graphs of {', '.join(r['name'] for r in cold['regions'])}"
         f"; cache {cold['cache']}; {cold['reason'] or 'compiled'} [compile]", model=spec.name, anchor="compile",
         **_keep(cold))
    emit(f"{spec.name} compile regional, warm restart", "ok" if warm["cache"] == "hit" else "FAIL",
         f"{warm['cold_compile_s']:.1f} s ({warm['cold_compile_s'] / max(cold['cold_compile_s'], 1e-9):.2f}x cold)",
         f"cache {warm['cache']} (dynamo reset, the same folder) [compile]", model=spec.name, **_keep(warm))
    for batch, times in per.items():
        ratio = statistics.median(times) / eager[batch]
        emit(f"{spec.name} compiled step tick, batch {batch}", "info", f"{ratio:.3f}x eager",
             f"{statistics.median(times) * 1e3:.1f} ms vs {eager[batch] * 1e3:.1f} ms eager (n={len(times)}) [compile]",
             model=spec.name, batch=batch, tick_s=times, ratio=ratio, anchor="compile")
    emit(f"{spec.name} recompiles after warm-up (batches {', '.join(map(str, per))})",
         "ok" if after["recompiles"] == 0 else "FAIL", str(after["recompiles"]),
         f"{after['graphs']} graphs in all [compile]", model=spec.name, recompiles=after["recompiles"])


def _keep(stats: dict) -> dict:
    return {k: stats[k] for k in ("mode_effective", "reason", "graphs", "cold_compile_s", "cache")}
