"""The step watchdog (engine.limits): what it costs a request, and how late it reacts to a step that makes no
progress. Prints spreads and run counts.

    .venv/bin/python bench/stall.py [--runs 5]

- cost: the same 20-step tiny-SD request with the watchdog on (the defaults) and off (both bounds null),
  interleaved in one run, in-process executor; the ratio of the medians.
- reaction: a request whose step blocks (an adapter that waits on an Event), stall_unready_s 0.5 and
  stall_fail_s 1.0: how long after each bound the engine reports stalled, then dead (StepStalled).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stats import machine, spread  # noqa: E402

from stage_runtime.models.families.sd import StableDiffusionAdapter  # noqa: E402

RELEASE = threading.Event()


class BlockingSDAdapter(StableDiffusionAdapter):
    """Prompt "block" waits until RELEASE is set: a step that makes no progress."""

    def run_batch(self, requests):
        if any(r.prompt == "block" for r in requests):
            RELEASE.wait()
        return super().run_batch(requests)


def engine_for(model: str, **limits):
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine

    return DiffusionEngine.make_engine(load_config({
        "model": {"path": model, "adapter": "stall:BlockingSDAdapter"}, "device": "cpu", "executor": "uni",
        "warmup": True, "limits": limits}))


def request(prompt: str, steps: int):
    from stage_runtime.request import DiffusionRequest, SamplingParams

    return DiffusionRequest(f"{prompt}-{time.perf_counter_ns()}", prompt, SamplingParams(num_inference_steps=steps,
                                                                                        seed=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    from stage_runtime.models.tiny import make_tiny_model

    model = str(make_tiny_model(tempfile.mkdtemp() + "/tiny-sd", kind="sd"))
    on, off = engine_for(model), engine_for(model, stall_unready_s=None, stall_fail_s=None)
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for _ in range(3 * args.runs):
            for name, engine in (("on", on), ("off", off)):
                t0 = time.perf_counter()
                engine.add_request(request("a cat", 20)).result(timeout=120)
                times[name].append(time.perf_counter() - t0)
    finally:
        on.close()
        off.close()

    import stall       # the module the engine imported the adapter from (this file runs as __main__)

    release = stall.RELEASE
    unready_late, dead_late = [], []
    for _ in range(args.runs):
        release.clear()
        engine = engine_for(model, stall_unready_s=0.5, stall_fail_s=1.0)
        try:
            t0 = time.perf_counter()
            stream = engine.add_request(request("block", 2))
            while engine.stall_reason is None:
                time.sleep(0.002)
            unready_late.append(time.perf_counter() - t0 - 0.5)
            while engine.dead_reason is None:
                time.sleep(0.002)
            dead_late.append(time.perf_counter() - t0 - 1.0)
            assert engine.dead_kind == "StepStalled", engine.dead_kind
            try:
                stream.result(timeout=10)
            except Exception as exc:  # noqa: BLE001 - the expected EngineDeadError, reported below
                assert type(exc).__name__ == "EngineDeadError", exc
        finally:
            release.set()                       # the blocked rank thread returns; close() can join it
            engine.close()

    ratio = statistics.median(times["on"]) / statistics.median(times["off"])
    print(f"ran on: {machine()}")
    print(f"workload: tiny SD 64x64, 20 steps, request mode, in-process executor; {3 * args.runs} runs each, "
          f"interleaved")
    print(f"  watchdog on (defaults):        {spread(times['on'])}")
    print(f"  watchdog off (bounds null):    {spread(times['off'])}")
    print(f"  ratio on/off (medians):        {ratio:.3f}")
    print(f"reaction, stall_unready_s 0.5 / stall_fail_s 1.0, {args.runs} runs:")
    print(f"  stalled reported after the unready bound: {spread(unready_late)}")
    print(f"  failed closed after the fail bound:       {spread(dead_late)}")


if __name__ == "__main__":
    main()
