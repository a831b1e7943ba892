"""Offload cost: per-step time and peak resident weights with and without each offload mode, side by side.

One model runner per mode runs in ONE process on the same tiny pipeline (built here, or --model DIR);
the modes are interleaved round-robin (the first mode rotates every repetition) so that drift hits all
of them alike. For each mode it reports:

    step ms      median time of one step-mode denoising tick (middle ticks: no encode, no decode)
    request ms   median time of one whole request in request mode (encode + steps + decode, loads included)
    peak MiB     peak bytes of managed weights materialised at once (measured on the storages by the
                 offloader; "none" = every managed weight, always resident)
    loads/req    unit transfers per request

Ratios are against mode "none". The offload tier here is cpu <-> disk (safetensors, memory-mapped).

    .venv/bin/python bench/offload.py [--kind sd|dit|both] [--steps 10] [--reps 5] [--threads 1] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # before anything imports huggingface_hub

import torch  # noqa: E402

from stage_runtime.config import load_config  # noqa: E402
from stage_runtime.request import DiffusionRequest, SamplingParams  # noqa: E402
from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput  # noqa: E402
from stage_runtime.worker.model_runner import DiffusionModelRunner  # noqa: E402

MODES = {
    "none": {},
    "model": {"mode": "model"},
    "layerwise": {"mode": "layerwise"},
    "layerwise-sync": {"mode": "layerwise", "prefetch": False, "resident_layers": 1},
}


def make_runner(path: str, offload: dict) -> DiffusionModelRunner:
    config = load_config({"model": {"path": path}, "device": "cpu", "offload": offload})
    runner = DiffusionModelRunner(config, torch.device("cpu"))
    runner.load_model()
    return runner


def new_wave(runner, rid: str, prompt: str, steps: int, seed: int, mode: str = "request") -> SchedulerOutput:
    request = DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed))
    return SchedulerOutput(step_id=1, scheduled_new_reqs=[NewRequestData(rid, request.resolve(runner.model_info))],
                           mode=mode)


def step_ticks(runner, rid: str, prompt: str, steps: int, seed: int) -> list[float]:
    """Seconds per tick of one step-mode request."""
    tick, times = new_wave(runner, rid, prompt, steps, seed, mode="step"), []
    for k in range(2, steps + 3):
        t0 = time.perf_counter()
        out = runner.execute_model(tick).get(rid)
        times.append(time.perf_counter() - t0)
        if out.error or out.finished:
            assert out.error is None, out.error
            return times
        tick = SchedulerOutput(step_id=k, scheduled_cached_req_ids=[rid], mode="step")
    raise RuntimeError(f"{rid} did not finish")


def one_request(runner, rid: str, prompt: str, steps: int, seed: int) -> float:
    t0 = time.perf_counter()
    out = runner.execute_model(new_wave(runner, rid, prompt, steps, seed)).get(rid)
    assert out.error is None, out.error
    return time.perf_counter() - t0


def bench_model(path: str, prompt: str, steps: int, reps: int) -> dict[str, dict]:
    runners = {mode: make_runner(path, offload) for mode, offload in MODES.items()}
    step_ms: dict[str, list[float]] = {m: [] for m in MODES}
    req_ms: dict[str, list[float]] = {m: [] for m in MODES}
    names = list(MODES)
    try:
        for mode in names:                                            # warm-up, not measured
            one_request(runners[mode], f"warm-{mode}", prompt, 2, 0)
        loads0 = {m: r.offload_stats().get("loads", 0) for m, r in runners.items()}
        for rep in range(reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for mode in order:
                ticks = step_ticks(runners[mode], f"s{rep}-{mode}", prompt, steps, rep)
                step_ms[mode] += [t * 1e3 for t in ticks[1:-1]]       # middle ticks: one denoise step each
                req_ms[mode].append(one_request(runners[mode], f"r{rep}-{mode}", prompt, steps, rep) * 1e3)
        out = {}
        for mode, runner in runners.items():
            stats = runner.offload_stats()
            out[mode] = {"step_ms": statistics.median(step_ms[mode]), "req_ms": statistics.median(req_ms[mode]),
                         "peak": stats.get("peak_resident_bytes"),
                         "loads_per_req": (stats.get("loads", 0) - loads0[mode]) / (2 * reps)}
        out["none"]["peak"] = runners["model"].offload_stats()["managed_bytes"]   # no offload: all resident
        return out
    finally:
        for runner in runners.values():
            runner.close()


def report(kind: str, results: dict[str, dict]) -> None:
    base = results["none"]
    print(f"\n{kind}: managed weights {base['peak'] / 2**20:.2f} MiB")
    print(f"  {'mode':<15}{'step ms':>9}{'ratio':>7}{'request ms':>12}{'ratio':>7}{'peak MiB':>10}{'ratio':>7}"
          f"{'loads/req':>11}")
    for mode, r in results.items():
        print(f"  {mode:<15}{r['step_ms']:>9.2f}{r['step_ms'] / base['step_ms']:>7.2f}{r['req_ms']:>12.1f}"
              f"{r['req_ms'] / base['req_ms']:>7.2f}{r['peak'] / 2**20:>10.3f}{r['peak'] / base['peak']:>7.2f}"
              f"{r['loads_per_req']:>11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=["sd", "dit", "both"], default="both")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", help="a diffusers folder instead of the built-in tiny models")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"offload bench: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} ({args.threads} thread(s)), device cpu, tier cpu<->disk "
          f"(offload files under {tempfile.gettempdir()}), {args.steps} steps, {args.reps} reps")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            models = [("model", args.model, "a red fox")]
        else:
            from stage_runtime.models.tiny import make_tiny_model

            kinds = ["sd", "dit"] if args.kind == "both" else [args.kind]
            models = [(k, str(make_tiny_model(os.path.join(tmp, k), kind=k, seed=0)),
                       "a red fox" if k == "sd" else "207") for k in kinds]
        for kind, path, prompt in models:
            report(f"tiny-{kind}" if not args.model else path, bench_model(path, prompt, args.steps, args.reps))


if __name__ == "__main__":
    main()
