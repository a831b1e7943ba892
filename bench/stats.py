"""Summaries every benchmark prints: median, min–max spread, the number of runs, and per-pair ratios.

A *pair* is one workload item measured on two paths back to back (interleaved, order rotated); the ratio
of each pair cancels slow drifts of the machine that medians of separate series do not.
"""

from __future__ import annotations

import os
import platform
import statistics


def spread(values: list[float], unit: str = "ms", scale: float = 1e3, digits: int = 2) -> str:
    """``median 12.34 ms (min 11.90 – max 13.10, n=40)``."""
    if not values:
        return "no samples"
    v = [x * scale for x in values]
    return (f"median {statistics.median(v):.{digits}f} {unit} (min {min(v):.{digits}f} – max {max(v):.{digits}f}, "
            f"n={len(v)})")


def pair_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """numerator[i] / denominator[i] for every pair."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} vs {len(denominator)} samples: not pairs")
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def ratio_summary(numerator: list[float], denominator: list[float]) -> str:
    """``per-pair ratio median 1.0123 (min 0.9811 – max 1.0670, n=40)``."""
    ratios = pair_ratios(numerator, denominator)
    return (f"per-pair ratio median {statistics.median(ratios):.4f} "
            f"(min {min(ratios):.4f} – max {max(ratios):.4f}, n={len(ratios)})")


def machine() -> str:
    """What the benchmark ran on, and how busy the machine was (load average) when it ended."""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), platform.processor())
    except OSError:
        cpu = platform.processor() or platform.machine()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{cpu}, {os.cpu_count()} cores, python {platform.python_version()}; "
            f"load average (1/5/15 min) {load} — other work on these cores adds noise")


def rotated_round(paths: dict, i: int, times: dict[str, list[float]], *args) -> dict:
    """Round ``i`` of an interleaved comparison: every path called once on ``args``, the order rotated by ``i``
    (no path always runs first or after the same neighbour); each call's seconds appended to ``times``.
    Returns each path's result."""
    import time

    order = list(paths.items())
    shift = i % len(order)
    results = {}
    for key, fn in order[shift:] + order[:shift]:
        t0 = time.perf_counter()
        results[key] = fn(*args)
        times[key].append(time.perf_counter() - t0)
    return results


def max_uint8_diff(results: dict, pairs: list[tuple[str, str]], diff: int = 0) -> int:
    """The largest |a - b| over the uint8 arrays of each (a, b) pair of paths (lists of arrays pairwise)."""
    import numpy as np

    for a, b in pairs:
        if a not in results:
            continue
        left, right = results[a], results[b]
        for got, ref in zip(*(([x] if not isinstance(x, list) else x) for x in (left, right)), strict=True):
            diff = max(diff, int(np.abs(got.astype(int) - ref.astype(int)).max()))
    return diff



def timed_engine(engine):
    """``engine`` with a record of every executed step's seconds (a tick, or a wave's seconds / its steps)."""
    engine.step_seconds = []
    engine.observers.add(lambda batch, seconds, steps: engine.step_seconds.append(seconds / max(1, steps)))
    return engine


def per_step(engine, requests) -> float:
    """The median seconds of one denoising step of a ``timed_engine`` while ``requests`` run together."""
    start = len(engine.step_seconds)
    for stream in [engine.add_request(r) for r in requests]:
        stream.result(timeout=900)
    return statistics.median(engine.step_seconds[start:])
