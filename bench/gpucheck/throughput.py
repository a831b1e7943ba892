"""Part 3: real-size throughput with random weights (gpucheck/sizes.py), each model for a few steps.

Per model, on one pipeline built on the device:

1. request mode: the engine (uni executor, the family's adapter over that pipeline: gpucheck/prebuilt.py) against
   the bare ``pipe(...)`` call, interleaved with the order rotated, after a warm-up of each; the ratio per pair,
   max|diff| of the images, the peak device memory;
2. step mode: one denoising tick of 1, 2 and 4 requests batched (one denoiser forward; the first tick, which
   encodes, and the decode are left out: the requests are finished early); the throughput gain of batch B is
   B x t(1) / t(B), "vs sequential";
3. compile (FLUX and Wan): the same ticks with the denoiser compiled ``regional``, its cold and warm compile and its
   recompiles (gpucheck/compiled.py);
4. quantization (FLUX): int8-weight and fp8 on freshly drawn weights, the denoiser's bytes and the tick against the
   unquantized one (gpucheck/quantized.py);
5. offload: the same tick with the weights on the host tier (model and layerwise) and the disk tier (layerwise;
   not for FLUX's 24 GB by default), each on a freshly built pipeline (an offloader owns weights until it closes);
   step time against no offload, and peak device memory.

Each figure names the topic of the published anchors it goes with (``[batching]``); the report lists them
(gpucheck/anchors.py).
"""

from __future__ import annotations

import statistics
import time

from gpucheck.compiled import COMPILED, compile_arm
from gpucheck.quantized import QUANTIZED, quantization_arm
from gpucheck.sleeping import SLEPT, sleep_arm
from gpucheck.families import Call, bare_call, max_diff, request
from gpucheck.residency import attach_offloader
from gpucheck.sizes import MODELS, build, parameters
from gpucheck.target import gib

BATCHES = (1, 2, 4)
LONG = 50                                  # steps a step-mode request asks for (finished before it gets there)


def config(folder: str, spec, target, mode: str, dtype: str, **sections):
    from stage_runtime.config import load_config

    return load_config({"model": {"path": folder, "adapter": spec.adapter, "dtype": dtype}, "device": target.device,
                        "executor": "uni", "warmup": False,
                        "scheduler": {"execution_mode": mode, "max_num_seqs": max(BATCHES)}, **sections})


def call_of(spec, shape: dict) -> Call:
    return Call(spec.guidance, size=shape["height"], frames=shape.get("num_frames"), prompt="a red fox in the snow")


def request_mode(folder, spec, pipe, shape, target, dtype, args, emit) -> None:
    from stats import rotated_round

    from stage_runtime.engine import DiffusionEngine

    call = call_of(spec, shape)
    engine = DiffusionEngine.make_engine(config(folder, spec, target, "request", dtype))
    paths = {"bare": lambda seed: bare_call(pipe, call, seed, args.steps, **shape),
             "engine": lambda seed: engine.add_request(request(call, f"r{seed}", seed, args.steps, **shape)).result(
                 timeout=900).images}
    try:
        for fn in paths.values():
            fn(0)                                                     # warm-up: kernels chosen, caches filled
        target.reset_peak()
        times: dict[str, list[float]] = {k: [] for k in paths}
        diff = 0
        for i in range(args.runs):
            out = rotated_round(paths, i, times, 100 + i)
            diff = max(diff, max_diff(out["engine"], out["bare"]))
        peak = target.peak_bytes()
    finally:
        engine.close()
    ratios = [e / b for e, b in zip(times["engine"], times["bare"], strict=True)]
    emit(f"{spec.name} request mode: engine / bare", "info", f"{statistics.median(ratios):.3f}x per pair",
         f"min-max {min(ratios):.3f}-{max(ratios):.3f} (n={args.runs}); bare {statistics.median(times['bare']):.2f} s, "
         f"engine {statistics.median(times['engine']):.2f} s ({args.steps} steps); max|diff| {diff}; peak {gib(peak)} "
         "[overhead]",
         model=spec.name, bare_s=times["bare"], engine_s=times["engine"], ratios=ratios, max_diff=diff,
         peak_bytes=peak, steps=args.steps, anchor="overhead")


def tick_times(runner, spec, shape, target, batch: int, ticks: int, tag: str) -> list[float]:
    """Seconds per denoising tick of ``batch`` requests together (after the first tick, which also encodes)."""
    from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput

    call = call_of(spec, shape)
    reqs = [request(call, f"{tag}{j}", 200 + j, LONG, **shape).resolve(runner.model_info) for j in range(batch)]
    rids = [r.request_id for r in reqs]
    step = SchedulerOutput(1, scheduled_new_reqs=[NewRequestData(r.request_id, r) for r in reqs], mode="step")
    times = []
    try:
        for k in range(ticks + 1):
            out, seconds = target.timed(runner.execute_model, step)
            failed = [o.error for o in out.outputs.values() if o.error]
            if failed:
                raise RuntimeError(failed[0])
            if k:
                times.append(seconds)
            step = SchedulerOutput(k + 2, scheduled_cached_req_ids=list(rids), mode="step")
    finally:
        runner.execute_model(SchedulerOutput(ticks + 3, finished_req_ids=set(rids), mode="step"))   # states dropped
    return times


def step_mode(folder, spec, shape, target, dtype, args, emit) -> dict[int, float]:
    from stats import spread

    from stage_runtime.worker.model_runner import DiffusionModelRunner

    runner = DiffusionModelRunner(config(folder, spec, target, "step", dtype), target.torch_device)
    runner.load_model()
    per = {}
    try:
        for batch in BATCHES:
            target.reset_peak()
            per[batch] = tick_times(runner, spec, shape, target, batch, args.ticks, f"b{batch}-")
            peak = target.peak_bytes()
            median = statistics.median(per[batch])
            topic = f"{spec.name} step" if batch == 1 else ""
            emit(f"{spec.name} step tick, batch {batch}", "info", f"{median * 1e3:.1f} ms per step",
                 f"{spread(per[batch])}; peak {gib(peak)}" + (f" [{topic}]" if topic else ""),
                 model=spec.name, batch=batch, tick_s=per[batch], peak_bytes=peak, anchor=topic)
            if batch > 1:
                gain = batch * statistics.median(per[1]) / median
                emit(f"{spec.name} step-mode batch {batch} vs sequential", "info", f"{gain:.2f}x throughput",
                     f"{batch} x {statistics.median(per[1]) * 1e3:.1f} ms vs {median * 1e3:.1f} ms [batching]",
                     model=spec.name, batch=batch, gain=gain, anchor="batching")
    finally:
        runner.close()
    return {batch: statistics.median(times) for batch, times in per.items()}


def offload_arm(folder, spec, shape, target, dtype, args, mode, tier_name, base_s, emit) -> None:
    from gpucheck.prebuilt import PIPES
    from stage_runtime.worker.model_runner import DiffusionModelRunner

    PIPES[folder] = build(spec.name, target)
    runner = DiffusionModelRunner(config(folder, spec, target, "step", dtype), target.torch_device)
    try:
        runner.load_model()
        start = time.perf_counter()
        attach_offloader(runner, target, mode, tier_name)          # copies every weight to the tier, releases it
        prepared = time.perf_counter() - start
        target.reset_peak()                                        # from here: what offloading keeps on the device
        times = tick_times(runner, spec, shape, target, 1, args.ticks, f"{mode}-{tier_name}-")
        peak, stats = target.peak_bytes(), runner.offload_stats()
    finally:
        runner.close()
        PIPES.pop(folder, None)
        target.free()
    median = statistics.median(times)
    emit(f"{spec.name} offload {mode} -> {tier_name} tier, step", "info",
         f"{median * 1e3:.1f} ms ({median / base_s:.2f}x no offload)",
         f"tier {stats['tier']}, peak {gib(peak)}, set up in {prepared:.1f} s (n={len(times)}) [offload]",
         model=spec.name, mode=mode, tier=stats["tier"], tick_s=times, ratio=median / base_s, peak_bytes=peak,
         prepare_s=prepared, anchor="offload")


def measure(name: str, target, clock, emit, root: str, args) -> None:
    from gpucheck.prebuilt import PIPES
    from stage_runtime.models.tiny import make_tiny_model

    spec = MODELS[name]
    folder = str(make_tiny_model(f"{root}/sized-{name}", kind=spec.tiny_kind))
    shape = spec.shape if target.sizes == "real" else spec.toy_shape
    dtype = target.dtype(spec.dtype)
    start = time.perf_counter()
    pipe = PIPES[folder] = build(name, target)
    denoiser = getattr(pipe, spec.denoiser)
    emit(f"{name} built ({target.sizes} size)", "info", f"{parameters(denoiser) / 1e6:,.1f} M denoiser parameters",
         f"{spec.published if target.sizes == 'real' else 'the tiny configs'}, {dtype}, {shape}, drawn in "
         f"{time.perf_counter() - start:.1f} s", model=name, parameters=parameters(denoiser), shape=shape, dtype=dtype)
    try:
        request_mode(folder, spec, pipe, shape, target, dtype, args, emit)
        eager = step_mode(folder, spec, shape, target, dtype, args, emit)
        if name in COMPILED:
            if clock.spent(need_s=args.compile_s):
                emit(f"{name} compile regional, cold", "budget", "", clock.reason(), model=name)
            else:
                compile_arm(folder, spec, shape, target, dtype, args, eager, emit, root, config, tick_times)
    finally:
        PIPES.pop(folder, None)
        del pipe, denoiser
        target.free()
    arms = [("model", "cpu"), ("layerwise", "cpu")] + ([("layerwise", "disk")] if name != "flux" or args.flux_disk
                                                        else [])
    for mode, tier_name in arms:
        check = f"{name} offload {mode} -> {tier_name} tier, step"
        if clock.spent(need_s=args.arm_s):
            emit(check, "budget", "", clock.reason(), model=name)
            continue
        offload_arm(folder, spec, shape, target, dtype, args, mode, tier_name, eager[1], emit)
    if name in QUANTIZED:
        if clock.spent(need_s=args.arm_s):
            emit(f"{name} quantization, step", "budget", "", clock.reason(), model=name)
        else:
            quantization_arm(folder, spec, shape, target, dtype, args, eager[1], emit, config, tick_times, build)
    if name in SLEPT:
        if clock.spent(need_s=args.arm_s):
            emit(f"{name} sleep level 1, wake", "budget", "", clock.reason(), model=name)
        else:
            sleep_arm(folder, spec, target, dtype, emit, config, build)
    if name == "flux" and not args.flux_disk:
        emit(f"{name} offload layerwise -> disk tier, step", "skip", "",
             "writing 24 GB of weights to disk is not worth the budget (--flux-disk runs it)", model=name)


def run(target, clock, emit, root: str, args) -> None:
    """Each model in turn; a model's offload arms stop at its share of what is left, so the next one gets its own."""
    from gpucheck.budget import Clock

    for i, name in enumerate(args.models):
        if clock.spent(need_s=args.model_s):
            emit(f"{name} throughput", "budget", "", clock.reason(), model=name)
            continue
        share = Clock(clock.left() / (len(args.models) - i))
        try:
            measure(name, target, share, emit, root, args)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a row; the next model still runs
            emit(f"{name} throughput", "error", "", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                 model=name)
            target.free()
