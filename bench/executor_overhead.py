"""What the multiprocess executor costs, measured side by side in one run.

1. Per-request overhead, ``uni`` (in process) vs ``mp`` with one rank (a spawned worker: broadcast,
   result channel, COMPUTE_DONE + OUTPUT_READY, pickling, shared memory over 1 MiB), at 64×64 and
   512×512 outputs. Both engines are up at once and requests alternate between them. Overhead per
   request = client wall time − the pipeline call's own time on the rank (``compute_ms``), so the
   number is not drowned by compute noise; the extra cost of ``mp`` is its median minus ``uni``'s.
2. Time per denoising step of CFG-parallel (2 ranks) and Ulysses (2 ranks) vs one rank, interleaved.
   On a 2-core machine with one thread per rank this measures the cost of the collectives and the
   extra process, not a speedup: a real speedup needs one GPU per rank (bench/gpu_smoke.py).
3. The same for ring attention (ring_degree 2) and tensor parallel (tensor_parallel_size 2) on tiny DiT
   (median, min–max, runs), and the bytes each kind of collective sends per denoising step and rank,
   counted by distributed.comm on 2 spawned gloo ranks running one step of one guided request.

    .venv/bin/python bench/executor_overhead.py [--requests 30] [--large-requests 3] [--steps 8] [--threads 1]
                                                [--parts 1,2,3]
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
    ap.add_argument("--parts", default="1,2,3", help="which parts to run (comma-separated)")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)            # inherited by the spawned ranks

    import torch

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model

    torch.set_num_threads(args.threads)
    model = str(make_tiny_model(tempfile.mkdtemp() + "/tiny-sd", kind="sd"))

    def engine(executor: str, path: str = model, **parallel) -> DiffusionEngine:
        return DiffusionEngine.make_engine(load_config({"model": {"path": path}, "device": "cpu",
                                                        "executor": executor, "parallel": parallel}))

    print(f"# executor overhead — {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.threads} thread(s) per rank, tiny SD")

    parts = {int(p) for p in args.parts.split(",")}
    if 1 in parts:
        per_request_overhead(engine, args)
    if 2 in parts:
        cfg_and_ulysses(engine, args)
    if 3 in parts:
        ring_and_tp(engine, args)


def per_request_overhead(engine, args) -> None:
    """Part 1: uni vs mp (1 rank) per-request overhead."""
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


def cfg_and_ulysses(engine, args) -> None:
    """Part 2: step time, one rank vs CFG-parallel vs Ulysses (tiny SD)."""
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


PARALLEL_PLANS = {"ring_degree=2": {"ring_degree": 2}, "tensor_parallel_size=2": {"tensor_parallel_size": 2},
                  "ulysses_degree=2": {"ulysses_degree": 2}}


def ring_and_tp(engine, args) -> None:
    """Part 3: step-time ratios of ring / TP / Ulysses vs one rank on tiny DiT, then bytes per step."""
    import warnings

    from stage_runtime.models.tiny import make_tiny_model

    dit = str(make_tiny_model(tempfile.mkdtemp() + "/tiny-dit", kind="dit"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                         # tp without ulysses warns
        engines = {"1 rank (uni)": engine("uni", dit)}
        engines.update({name: engine("mp", dit, **parallel) for name, parallel in PARALLEL_PLANS.items()})
    per_step: dict[str, list[float]] = {name: [] for name in engines}
    runs = max(3, args.requests // 3)
    for i in range(runs + 1):
        for name in (list(engines) if i % 2 else list(engines)[::-1]):
            out = engines[name].generate("7", seed=i, num_inference_steps=args.steps)
            if i:
                per_step[name].append(out.metrics["compute_ms"] / args.steps)
    for eng in engines.values():
        eng.close()
    base = statistics.median(per_step["1 rank (uni)"])
    print(f"\n## time per denoising step, tiny DiT 256 tokens, guidance 4 ({args.steps} steps, {runs} runs; ms)")
    for name, values in per_step.items():
        med = statistics.median(values)
        print(f"{name:>24} {med:8.2f} ms  [{min(values):.2f}–{max(values):.2f}]   ratio vs 1 rank {med / base:5.2f}")
    print("(2 CPU cores, one thread per rank: this is the cost of the collectives, not a speedup)")
    print("\n## bytes sent per denoising step and rank (one guided request: 2 rows), by collective")
    for name, parallel in PARALLEL_PLANS.items():
        for rank, sent in sorted(traffic(dit, parallel).items()):
            print(f"{name:>24} rank {rank}  " + "  ".join(f"{k} {v / 1024:.1f} KiB" for k, v in sorted(sent.items())))


def _traffic_rank(rank: int, path: str, parallel: dict, rendezvous: str, results) -> None:
    import warnings

    import torch

    torch.set_num_threads(1)
    from stage_runtime.config import ModelConfig, ParallelConfig
    from stage_runtime.distributed.apply import apply_parallelism
    from stage_runtime.distributed.comm import BYTES_SENT
    from stage_runtime.distributed.groups import destroy_distributed, init_distributed
    from stage_runtime.models.registry import resolve_adapter_class
    from stage_runtime.request import DiffusionRequest, SamplingParams

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = ParallelConfig(**parallel)
    groups = init_distributed(config, rank, rendezvous, torch.device("cpu"), 60.0)
    try:
        adapter = resolve_adapter_class(ModelConfig(path=path)).load(path, torch.device("cpu"))
        apply_parallelism(adapter, groups, config)
        request = DiffusionRequest("r", "7", SamplingParams(num_inference_steps=4, seed=0)).resolve(adapter.info())
        with torch.inference_mode():
            state = adapter.prepare_encode(request)
            adapter.denoise_step([state])                       # warm
            BYTES_SENT.clear()
            adapter.denoise_step([state])
        results.put((rank, dict(BYTES_SENT)))
    finally:
        destroy_distributed()


def traffic(path: str, parallel: dict) -> dict[int, dict[str, int]]:
    """Bytes each of 2 spawned gloo ranks sends during one denoising step, by kind of collective."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ds-bench-") as folder:
        procs = [ctx.Process(target=_traffic_rank, args=(r, path, parallel, f"file://{folder}/rdv", results))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            return dict(results.get(timeout=300) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()


if __name__ == "__main__":
    main()
