"""Step mode vs request mode: latency, admission, abort and burst throughput, measured side by side.

Engines of both execution modes run in ONE process on the same model (uni executor). Where two designs
are compared the measurements are interleaved. Prints what it ran on, the numbers per section and a
summary of each number next to its target (informational: the exit status is 0 unless state leaked).

    S6  one request (20 steps) through request mode vs step mode, max_num_seqs 1: medians and ratio
    S7  admission: a short request (4 steps) submitted while a long one (60) runs; time to its first step
    S8  abort: abort at a random step, time from ``abort()`` to the terminal output on the stream
    S9  burst: 16 requests at once, max_num_seqs 1 vs 4, both modes: requests/s

    .venv/bin/python bench/step_mode.py [--threads 1] [--size 64] [--seed 0] [--model DIR]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import random
import statistics
import tempfile
import time

import numpy as np

from stage_runtime.errors import RequestAbortedError
from stage_runtime.request import DiffusionRequest, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # before anything imports huggingface_hub

_ids = itertools.count()
TIMEOUT = 120.0


def ms(seconds: float) -> float:
    return seconds * 1e3


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


def request(prompt: str, seed: int, steps: int, size: int, stream: bool = False) -> DiffusionRequest:
    sampling = SamplingParams(num_inference_steps=steps, seed=seed, height=size, width=size, guidance_scale=7.5,
                              stream=stream)
    return DiffusionRequest(f"bench-{next(_ids)}", prompt, sampling)


def wait_step(stream, k: int) -> None:
    """Read progress items until one with step_index >= k."""
    for item in stream:
        if item.finished:
            raise RuntimeError(f"{stream.request_id} finished before step {k}: {item.error}")
        if item.step_index >= k:
            return


def progress_times(stream) -> list[tuple[int, float]]:
    """(step_index, arrival time) of every progress item, until the terminal item (read and dropped)."""
    return [(item.step_index, time.perf_counter()) for item in stream if not item.finished]


def gaps(times: list[tuple[int, float]]) -> list[float]:
    return [b - a for (_, a), (_, b) in itertools.pairwise(times)]


def step_gaps(engine, size: int, reps: int = 3) -> list[float]:
    """Times between progress items of a lone 20-step streamed request: one step (tick) each."""
    return [g for i in range(reps)
            for g in gaps(progress_times(engine.add_request(request(f"tick {i}", 7 + i, 20, size, stream=True))))]


def s6_latency(eng_req, eng_step, n: int, steps: int, size: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"request": [], "step": []}
    engines = [("request", eng_req), ("step", eng_step)]
    for i in range(n):
        for name, engine in engines[i % 2:] + engines[:i % 2]:      # alternate which mode goes first
            t0 = time.perf_counter()
            engine.add_request(request("a photo of a red fox", 1234, steps, size)).result(TIMEOUT)
            times[name].append(time.perf_counter() - t0)
    return times


def s7_time_to_first_step(engine, size: int, phase_s: float) -> tuple[float, list[float]]:
    """Long request running (step >= 3), then a short one: add_request → its step-1 item; 2-request ticks."""
    long = engine.add_request(request("a long request", 11, 60, size, stream=True))
    wait_step(long, 3)
    time.sleep(phase_s)                                   # land anywhere inside the running tick
    t0 = time.perf_counter()
    short = engine.add_request(request("a short request", 12, 4, size, stream=True))
    times = progress_times(short)       # steps 1..3 share ticks with the long request; 4 ends in the decode
    assert times[0][0] == 1, times
    raw, ticks = times[0][1] - t0, gaps(times)
    engine.abort(long.request_id)
    try:
        long.result(TIMEOUT)
    except RequestAbortedError:
        pass                                              # request mode: it had already completed
    return raw, ticks


def s8_abort(engine, n: int, size: int, rng: random.Random, step_s: float) -> list[float]:
    """Abort each request at a random step (1..40) and phase; seconds until its terminal output."""
    lat = []
    for i in range(n):
        stream = engine.add_request(request(f"abort me {i}", 100 + i, 60, size, stream=True))
        wait_step(stream, rng.randint(1, 40))
        time.sleep(rng.uniform(0, step_s))
        t0 = time.perf_counter()
        engine.abort(stream.request_id)
        try:
            stream.result(TIMEOUT)
        except RequestAbortedError:
            lat.append(time.perf_counter() - t0)
        else:
            raise RuntimeError(f"{stream.request_id} completed although it was aborted")
    return lat


def s9_burst(engine, n: int, steps: int, size: int) -> float:
    """Submit n requests at once; requests/s until the last one finished."""
    requests = [request(f"burst prompt {i}", 500 + i, steps, size) for i in range(n)]
    t0 = time.perf_counter()
    for stream in [engine.add_request(r) for r in requests]:
        stream.result(TIMEOUT)
    return n / (time.perf_counter() - t0)


def leaked_states(engine) -> tuple[int, int]:
    """(engine, runner) per-request states, after giving a pending empty tick a moment to retire aborts."""
    runner = engine.executor.worker.model_runner
    deadline = time.monotonic() + 2.0
    while (engine.num_request_states() or runner.num_request_states()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.num_request_states(), runner.num_request_states()


def print_quantiles(label: str, xs: list[float]) -> None:
    print(f"    {label:32s} p50 {ms(pct(xs, 50)):7.1f}  p99 {ms(pct(xs, 99)):7.1f} ms")


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    platform.processor())


Row = tuple[str, str, str, "bool | None"]        # summary: name, value, target, ok (None: informational)


def section_s6(eng_req, eng_step, n: int, size: int) -> tuple[float, float, list[Row]]:
    step_g, req_g = step_gaps(eng_step, size), step_gaps(eng_req, size)
    step_s, req_step_s = statistics.median(step_g), statistics.median(req_g)
    lat = s6_latency(eng_req, eng_step, n, 20, size)
    med_req, med_step = statistics.median(lat["request"]), statistics.median(lat["step"])
    ratio = med_step / med_req
    print(f"\nS6 latency, 20 steps, max_num_seqs 1, n={n} each, interleaved")
    print(f"  median request mode {ms(med_req):8.1f} ms   step mode {ms(med_step):8.1f} ms   "
          f"ratio step/request {ratio:.3f}")
    print(f"  step time from progress gaps, mean (median): step mode {ms(statistics.mean(step_g)):.2f} "
          f"({ms(step_s):.2f}) ms | request mode {ms(statistics.mean(req_g)):.2f} ({ms(req_step_s):.2f}) ms"
          f" | request latency / 20 = {ms(med_req) / 20:.2f} ms")
    return step_s, req_step_s, [("S6 step/request latency ratio", f"{ratio:.3f}", "<= 1.10", ratio <= 1.10),
                                ("S6 step time (step mode tick)", f"{ms(step_s):.2f} ms", "", None)]


def section_s7(eng_step, eng_req, args, rng: random.Random, step_s: float, req_step_s: float) -> list[Row]:
    raws, ticks = [], []
    for _ in range(args.admission_n):
        raw, t = s7_time_to_first_step(eng_step, args.size, rng.uniform(0, step_s))
        raws.append(raw)
        ticks += t
    tick2 = statistics.median(ticks)
    adj = [r - tick2 for r in raws]
    req_raw = [s7_time_to_first_step(eng_req, args.size, rng.uniform(0, req_step_s))[0]
               for _ in range(args.admission_request_n)]
    req_adj = [r - req_step_s for r in req_raw]
    print("\nS7 admission: short (4 steps) while long (60 steps) runs at step >= 3, random phase in the tick")
    print(f"  step mode (max_num_seqs 2), n={args.admission_n}: 2-request tick {ms(tick2):.2f} ms")
    print_quantiles("add_request -> first step, raw", raws)
    print_quantiles("minus one 2-request tick", adj)
    print(f"  request mode (max_num_seqs 1: waits for the long request), n={len(req_raw)}")
    print_quantiles("add_request -> first step, raw", req_raw)
    print_quantiles("minus one step", req_adj)
    target = step_s + 0.005
    return [("S7 admission p99 minus 1 tick", f"{ms(pct(adj, 99)):.1f} ms", f"<= {ms(target):.1f} ms (1 step+5)",
             pct(adj, 99) <= target),
            ("S7 same, request mode p50", f"{ms(pct(req_adj, 50)):.1f} ms", "(for contrast)", None)]


def section_s8(eng_step, eng_req, args, rng: random.Random, step_s: float, req_step_s: float) -> list[Row]:
    print("\nS8 abort at a random step (1..40) and phase, 60-step requests, one at a time")
    rows = []
    for name, engine, n, unit in (("step mode", eng_step, args.abort_n, step_s),
                                  ("request mode", eng_req, args.abort_request_n, req_step_s)):
        xs = s8_abort(engine, n, args.size, rng, unit)
        p50, p99 = pct(xs, 50), pct(xs, 99)
        print(f"  {name:12s} n={n:2d}: p50 {ms(p50):6.1f} ms ({p50 / unit:.2f} steps)  "
              f"p99 {ms(p99):6.1f} ms ({p99 / unit:.2f} steps)  max {ms(max(xs)):6.1f} ms")
        rows.append((f"S8 abort p99, {name}", f"{ms(p99):.1f} ms", f"<= {ms(unit + 0.010):.1f} ms (1 step+10)",
                     p99 <= unit + 0.010))
    return rows


def section_s9(engines: dict, args) -> list[Row]:
    rps: dict[str, list[float]] = {k: [] for k in ("step1", "step4", "req1", "req4")}
    for r in range(args.burst_rounds):
        order = list(rps)
        for name in order[r % 4:] + order[:r % 4]:              # rotate which engine goes first
            rps[name].append(s9_burst(engines[name], args.burst, 10, args.size))
    med = {k: statistics.median(v) for k, v in rps.items()}
    print(f"\nS9 burst: {args.burst} requests at once, 10 steps, different prompts/seeds, "
          f"median of {args.burst_rounds} rounds")
    rows = []
    for mode, one, four in (("step", "step1", "step4"), ("request", "req1", "req4")):
        print(f"  {mode:7s} mode: max_num_seqs 1 {med[one]:6.2f} req/s | max_num_seqs 4 {med[four]:6.2f} req/s "
              f"| ratio {med[four] / med[one]:.2f}x")
        rows.append((f"S9 burst {mode} mode seqs 4 / 1", f"{med[four] / med[one]:.2f}x", "", None))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--threads", 1), ("--size", 64), ("--seed", 0), ("--latency-n", 15),
                          ("--admission-n", 10), ("--admission-request-n", 3), ("--abort-n", 30),
                          ("--abort-request-n", 15), ("--burst", 16), ("--burst-rounds", 2)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--model", help="a diffusers SD folder (default: build the tiny one)")
    args = ap.parse_args()

    import torch

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rng = random.Random(args.seed)
    model = args.model or str(make_tiny_model(tempfile.mkdtemp() + "/tiny-sd", kind="sd"))

    def engine(mode: str, seqs: int, **sched):
        config = {"model": {"path": model}, "device": "cpu",
                  "scheduler": {"execution_mode": mode, "max_num_seqs": seqs, **sched}}
        return DiffusionEngine.make_engine(load_config(config))

    # request mode with capacity > 1 waits briefly so a burst fuses into full waves
    engines = {"req1": engine("request", 1), "step1": engine("step", 1), "step2": engine("step", 2),
               "req4": engine("request", 4, request_batch_max_wait_ms=20), "step4": engine("step", 4)}
    for e in engines.values():                            # warm every engine beyond its 2-step warmup
        e.add_request(request("warm", 0, 4, args.size)).result(TIMEOUT)
    size = args.size
    print(f"ran on: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} thread), python {platform.python_version()}")
    print(f"workload: tiny SD {size}x{size}, guidance 7.5, uni executor, engines side by side in one process")

    step_s, req_step_s, rows = section_s6(engines["req1"], engines["step1"], args.latency_n, size)
    rows += section_s7(engines["step2"], engines["req1"], args, rng, step_s, req_step_s)
    rows += section_s8(engines["step1"], engines["req1"], args, rng, step_s, req_step_s)
    rows += section_s9(engines, args)

    leaks = {name: leaked_states(e) for name, e in engines.items()}
    print("\nleaked per-request state (engine, runner): " + ", ".join(f"{k}={v}" for k, v in leaks.items()))
    for e in engines.values():
        e.close()
    leaked = sum(sum(v) for v in leaks.values())
    rows.append(("leaked request state", str(leaked), "== 0", leaked == 0))
    print(f"\nsummary ({time.perf_counter() - started:.0f} s)")
    for name, value, target, ok in rows:
        print(f"  {name:34s} {value:>12s}   {target:30s} {'info' if ok is None else 'PASS' if ok else 'MISS'}")
    assert leaked == 0, f"leaked request state: {leaks}"


if __name__ == "__main__":
    main()
