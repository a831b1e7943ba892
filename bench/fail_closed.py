"""Fail-closed reaction times of the multiprocess executor: SIGKILL a worker rank → the engine latched dead
(with a request in flight, and idle), and close() after death. Prints spreads and run counts.

    .venv/bin/python bench/fail_closed.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stats import machine, spread  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.errors import EngineDeadError
    from stage_runtime.models.tiny import make_tiny_model
    from stage_runtime.request import DiffusionRequest, SamplingParams

    model = str(make_tiny_model(tempfile.mkdtemp() + "/tiny-sd", kind="sd"))
    busy, idle, close = [], [], []
    for run in range(args.runs):
        for in_flight in (True, False):
            config = load_config({"model": {"path": model}, "device": "cpu", "executor": "mp", "warmup": False,
                                  "parallel": {"cfg_parallel_size": 2}})
            engine = DiffusionEngine.make_engine(config)
            try:
                stream = None
                if in_flight:
                    stream = engine.add_request(DiffusionRequest(f"victim-{run}", "a cat",
                                                                 SamplingParams(num_inference_steps=500, stream=True)))
                    stream.get(timeout=120)                     # running
                t0 = time.perf_counter()
                os.kill(engine.executor.procs[1].pid, signal.SIGKILL)
                if stream is not None:
                    try:
                        stream.result(timeout=60)
                    except EngineDeadError:
                        pass
                else:
                    while engine.state != "dead":
                        time.sleep(0.001)
                (busy if in_flight else idle).append(time.perf_counter() - t0)
                t1 = time.perf_counter()
                engine.close()
                close.append(time.perf_counter() - t1)
            finally:
                engine.close()
    print(f"ran on: {machine()}")
    print(f"workload: tiny SD, mp executor, 2 ranks (cfg_parallel_size 2), rank 1 SIGKILLed; {args.runs} runs each")
    print(f"  kill → the in-flight request's EngineDeadError: {spread(busy)}")
    print(f"  kill → engine state 'dead' while idle:           {spread(idle)}")
    print(f"  close() after the death (ranks gone, shm swept):  {spread(close)}")


if __name__ == "__main__":
    main()
