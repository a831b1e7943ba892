"""What the multiprocess executor costs, measured side by side in one run.

1. Per-request overhead, ``uni`` (in process) vs ``mp`` with one rank (a spawned worker: broadcast,
   result channel, COMPUTE_DONE + OUTPUT_READY, pickling, shared memory over 1 MiB), at 64×64 and
   512×512 outputs. Both engines are up at once and requests alternate between them. Overhead per
   request = client wall time − the pipeline call's own time on the rank (``compute_ms``), so the
   number is not drowned by compute noise; the extra cost of ``mp`` is its median minus ``uni``'s.
2. Time per denoising step of CFG-parallel (2 ranks) and Ulysses (2 ranks) vs one rank, interleaved.
   On a 2-core machine with one thread per rank this measures the cost of the collectives and the
   extra process, not a speedup: a real speedup needs one GPU per rank (see the GPU smoke script).

    .venv/bin/python bench/executor_overhead.py [--requests 30] [--large-requests 3] [--steps 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30, help="requests per engine at 64x64")
    ap.add_argument("--large-requests", type=int, default=3, help="requests per engine at 512x512 (slow on CPU)")
    ap.add_argument("--steps", type=int, default=8, help="denoising steps for the parallel step-time part")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)            # inherited by the spawned ranks

    import torch

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model

    torch.set_num_threads(args.threads)
    model = str(make_tiny_model(tempfile.mkdtemp() + "/tiny-sd", kind="sd"))

    def engine(executor: str, **parallel) -> DiffusionEngine:
        return DiffusionEngine.make_engine(load_config({"model": {"path": model}, "device": "cpu",
                                                        "executor": executor, "parallel": parallel}))

    print(f"# executor overhead — {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.threads} thread(s) per rank, tiny SD")

    # -- 1. uni vs mp (1 rank) per-request overhead ----------------------------------------------------
    engines = {"uni": engine("uni"), "mp": engine("mp")}
    print("\n## per-request overhead (wall − compute), ms")
    print(f"{'output':>14} {'n':>3} {'uni p50':>8} {'mp p50':>8} {'mp p90':>8} {'extra p50':>10} "
          f"{'wall uni':>9} {'wall mp':>9} {'ratio':>6}")
    for size, count, sampling in ((64, args.requests, {"num_inference_steps": 4}),
                                  (512, args.large_requests, {"num_inference_steps": 1, "guidance_scale": 1.0})):
        overhead: dict[str, list[float]] = {name: [] for name in engines}
        wall: dict[str, list[float]] = {name: [] for name in engines}
        for i in range(count + 1):
            order = list(engines) if i % 2 else list(engines)[::-1]
            for name in order:
                t0 = time.perf_counter()
                out = engines[name].generate("a red cat", seed=i, height=size, width=size, **sampling)
                elapsed = (time.perf_counter() - t0) * 1e3
                if i:                                              # request 0 warms the path
                    overhead[name].append(elapsed - out.metrics["compute_ms"])
                    wall[name].append(elapsed)
        u, m = statistics.median(overhead["uni"]), statistics.median(overhead["mp"])
        wu, wm = statistics.median(wall["uni"]), statistics.median(wall["mp"])
        print(f"{f'{size}x{size}x3':>14} {count:>3} {u:8.2f} {m:8.2f} {pct(overhead['mp'], 0.9):8.2f} "
              f"{m - u:10.2f} {wu:9.1f} {wm:9.1f} {wm / wu:6.3f}")
    for eng in engines.values():
        eng.close()

    # -- 2. step time: one rank vs CFG-parallel vs Ulysses ---------------------------------------------
    plans = {"1 rank (uni)": ("uni", {}), "cfg_parallel_size=2": ("mp", {"cfg_parallel_size": 2}),
             "ulysses_degree=2": ("mp", {"ulysses_degree": 2})}
    engines = {name: engine(executor, **parallel) for name, (executor, parallel) in plans.items()}
    per_step: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(max(3, args.requests // 3) + 1):
        for name in (list(engines) if i % 2 else list(engines)[::-1]):
            out = engines[name].generate("a red cat", seed=i, num_inference_steps=args.steps)
            if i:
                per_step[name].append(out.metrics["compute_ms"] / args.steps)
    base = statistics.median(per_step["1 rank (uni)"])
    print(f"\n## time per denoising step, 64x64, guidance 7.5 ({args.steps} steps; compute on rank 0, ms)")
    for name, values in per_step.items():
        med = statistics.median(values)
        print(f"{name:>22} {med:8.2f} ms   ratio vs 1 rank {med / base:5.2f}")
    print("(on CPU cores this is the collectives' and the extra process's cost, not a GPU speedup)")
    for eng in engines.values():
        eng.close()


if __name__ == "__main__":
    main()
