"""How long an ``mp`` engine takes to start its ranks and answer one request, by start method.

For each of ``forkserver`` (the default) and ``spawn``, a fresh Python process (so the fork server starts from
nothing, as it does in a new stage process) builds a 2-rank CFG-parallel engine on the tiny SD pipeline, runs
one 2-step 64x64 request and closes it, ``--engines`` times in a row. The first forkserver engine pays for the
server's own imports; the later ones fork from it, as every engine after the first does in one process (a
restarted engine, the test suite). Prints per method the first engine and the later ones (median, min–max, n),
the ratio of the medians, and what it ran on.

    .venv/bin/python bench/rank_start.py [--engines 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stats import machine, spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys, time
from stage_runtime.config import load_config
from stage_runtime.engine import DiffusionEngine

if __name__ == "__main__":
    method, model, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        engine = DiffusionEngine.make_engine(load_config({
            "model": {"path": model}, "device": "cpu", "executor": "mp", "warmup": False,
            "worker_start_method": method, "parallel": {"cfg_parallel_size": 2}}))
        started = time.perf_counter() - t0
        engine.generate("a cat", num_inference_steps=2, seed=1, height=64, width=64)
        engine.close()
        out.append([started, time.perf_counter() - t0])
    print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4, help="engines per process, one after another")
    ap.add_argument("--rounds", type=int, default=2, help="fresh processes per method (alternating methods)")
    args = ap.parse_args()

    from stage_runtime.models.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="rank-start-"))
    model = str(make_tiny_model(work / "tiny-sd", kind="sd"))
    script = work / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    first: dict[str, list[float]] = {"forkserver": [], "spawn": []}
    later: dict[str, list[float]] = {"forkserver": [], "spawn": []}
    for _ in range(args.rounds):
        for method in first:
            done = subprocess.run([sys.executable, str(script), method, model, str(args.engines)], env=env,
                                  capture_output=True, text=True, check=True, cwd=work)
            totals = [total for _, total in json.loads(done.stdout.strip().splitlines()[-1])]
            first[method].append(totals[0])
            later[method].extend(totals[1:])
    print(f"ran on: {machine()}")
    print(f"workload: 2-rank CFG-parallel tiny SD engine (mp executor), start + one 2-step 64x64 request + close; "
          f"{args.rounds} fresh processes per method x {args.engines} engines each, methods alternating")
    for method in first:
        print(f"  {method:10s} first engine in a process  {spread(first[method], 's', 1, 2)}")
        print(f"  {method:10s} every later engine         {spread(later[method], 's', 1, 2)}")
    print(f"later engines, spawn ÷ forkserver (medians): "
          f"{statistics.median(later['spawn']) / statistics.median(later['forkserver']):.1f}x; "
          f"first engines: {statistics.median(first['spawn']) / statistics.median(first['forkserver']):.2f}x")


if __name__ == "__main__":
    main()
