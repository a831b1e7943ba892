"""Distributed layerwise offload (DLO): what a rank holds, what the gathers cost, and the throughput, side by side.

Four real engines (the multiproc executor, one worker process per rank, gloo) on the same tiny pipeline (built here,
or --model DIR), started once and measured round-robin (the first topology rotates every repetition) so drift hits
all of them alike:

    dp1-whole     one rank holding the whole denoiser, two requests fused per call (the baseline of every ratio)
    dp2-copies    two data-parallel ranks, each a whole copy, a wave of two split one per rank (plain DP: what DLO
                  saves memory against)
    tp2, ulysses2 the DiT only (the UNet has neither): two ranks serving one request together, tensor parallel
                  (each rank half of every sharded weight; not measured here: the weight stats count the bytes as
                  loaded, before the cut) or Ulysses (each rank a whole copy, half the tokens)
    dp2-dlo       two ranks, each 1/2 of the denoiser, each block all-gathered before it runs, the next block's
                  gather started while the current one runs (prefetch, the default)
    dp2-dlo-sync  the same without prefetch (resident_layers 1): every gather waited for in full

For each topology it reports:

    req/s         requests answered per second: --requests requests submitted at once, from the first submit to
                  the last answer (median over --reps, with the min-max spread)
    at rest       bytes of the denoiser one rank holds between calls (DLO: its shards; TP: its slices; else a whole
                  copy) and the ratio to a full copy
    window        the most denoiser bytes one rank had materialised at once (gathered blocks + its shards)
    gather ms     per block gather: from its start to the block having its weights (all ranks' bytes arrived)
    wait ms       per block gather: the part the rank waited for (the rest overlapped the previous block)

Each rank runs one torch thread (OMP_NUM_THREADS=1): a rank stands for a GPU, so dp=2 uses two cores where dp=1
uses one, as two GPUs would. On a CPU the gather is a memory copy over loopback gloo, far cheaper relative to a GPU's
compute than NVLink or PCIe would make it: the ratios say what the code path costs here, not on a GPU (the GPU check's
DLO row, bench/gpucheck/dlo.py, runs it on a device).

    .venv/bin/python bench/dlo.py [--kind sd|dit|both] [--steps 8] [--requests 4] [--reps 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # before anything imports huggingface_hub
os.environ["OMP_NUM_THREADS"] = "1"                    # one thread per rank, inherited by the worker processes

import torch  # noqa: E402

from stage_runtime.config import load_config  # noqa: E402
from stage_runtime.engine.engine import DiffusionEngine  # noqa: E402
from stage_runtime.request import DiffusionRequest, SamplingParams  # noqa: E402

TOPOLOGIES = {       # every topology runs two requests at once (a DLO wave is max_num_seqs x dp)
    "dp1-whole": {"parallel": {"num_gpus": 1}, "max_num_seqs": 2},
    "dp2-copies": {"parallel": {"num_gpus": 2}, "max_num_seqs": 2},
    "tp2": {"parallel": {"num_gpus": 2, "tensor_parallel_size": 2}, "max_num_seqs": 2, "kinds": ("dit",)},
    "ulysses2": {"parallel": {"num_gpus": 2, "ulysses_degree": 2}, "max_num_seqs": 2, "kinds": ("dit",)},
    "dp2-dlo": {"parallel": {"num_gpus": 2}, "offload": {"mode": "distributed"}},
    "dp2-dlo-sync": {"parallel": {"num_gpus": 2},
                     "offload": {"mode": "distributed", "prefetch": False, "resident_layers": 1}},
}


def make_engine(path: str, topology: dict) -> DiffusionEngine:
    topology = {k: v for k, v in topology.items() if k != "kinds"}
    seqs = topology.pop("max_num_seqs", 1)
    return DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "executor": "mp", **topology,
        "scheduler": {"max_num_seqs": seqs, "request_batch_max_wait_ms": 50}}))


def burst(engine: DiffusionEngine, tag: str, prompt: str, n: int, steps: int) -> float:
    """Seconds from submitting n different requests at once to the last answer."""
    t0 = time.perf_counter()
    streams = [engine.add_request(DiffusionRequest(f"{tag}-{i}", prompt, SamplingParams(
        num_inference_steps=steps, seed=i))) for i in range(n)]
    for stream in streams:
        result = stream.result(600)
        assert result.ok, result
    return time.perf_counter() - t0


def denoiser_bytes(engine: DiffusionEngine) -> int:
    """The most denoiser bytes one rank loaded (a whole copy, or a tensor-parallel shard)."""
    components = engine.weights[0]["components"]
    denoiser = "unet" if "unet" in components else "transformer"
    return max(w["components"][denoiser]["bytes"] for w in engine.weights)


def bench_model(kind: str, path: str, prompt: str, steps: int, n: int, reps: int) -> dict[str, dict]:
    engines: dict[str, DiffusionEngine] = {}
    try:
        for name, topology in TOPOLOGIES.items():
            if kind not in topology.get("kinds", (kind,)):
                continue
            engines[name] = make_engine(path, topology)
            burst(engines[name], f"warm-{name}", prompt, 2, 2)            # not measured
        before = {name: e.collective_rpc("offload_stats") for name, e in engines.items()}
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        names = list(engines)
        for rep in range(reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                seconds[name].append(burst(engines[name], f"r{rep}-{name}", prompt, n, steps))
        full = denoiser_bytes(engines["dp1-whole"])
        out = {}
        for name, engine in engines.items():
            rates = sorted(n / s for s in seconds[name])
            stats, stats0 = engine.collective_rpc("offload_stats"), before[name]
            # TP: the weight stats are the bytes as loaded, before the cut; its shard is not measured here
            loaded = None if engine.config.parallel.tensor_parallel_size > 1 else denoiser_bytes(engine)
            row = {"rate": statistics.median(rates), "min": rates[0], "max": rates[-1], "full": full,
                   "at_rest": loaded, "window": loaded, "gather_ms": None, "wait_ms": None}
            if stats and stats[0].get("world"):
                gathers = sum(s["gathers"] - s0["gathers"] for s, s0 in zip(stats, stats0, strict=True))
                row.update(at_rest=max(s["shard_bytes"] for s in stats),
                           window=max(s["peak_resident_bytes"] + s["shard_bytes"] for s in stats),
                           gather_ms=1e3 * sum(s["gather_seconds"] - s0["gather_seconds"]
                                               for s, s0 in zip(stats, stats0, strict=True)) / max(gathers, 1),
                           wait_ms=1e3 * sum(s["gather_wait_seconds"] - s0["gather_wait_seconds"]
                                             for s, s0 in zip(stats, stats0, strict=True)) / max(gathers, 1))
            out[name] = row
        return out
    finally:
        for engine in engines.values():
            engine.close()


def report(kind: str, results: dict[str, dict], reps: int) -> None:
    base = results["dp1-whole"]
    print(f"\n{kind}: denoiser {base['full'] / 2**20:.2f} MiB (a full copy); {reps} reps, median [min-max]")
    print(f"  {'topology':<14}{'req/s':>8}{'[min-max]':>16}{'ratio':>7}{'at rest MiB':>13}{'ratio':>7}"
          f"{'window MiB':>12}{'gather ms':>11}{'wait ms':>9}")
    for name, r in results.items():
        gather = "-" if r["gather_ms"] is None else f"{r['gather_ms']:.3f}"
        wait = "-" if r["wait_ms"] is None else f"{r['wait_ms']:.3f}"
        spread = f"[{r['min']:.2f}-{r['max']:.2f}]"
        memory = (f"{'-':>13}{'-':>7}{'-':>12}" if r["at_rest"] is None else
                  f"{r['at_rest'] / 2**20:>13.3f}{r['at_rest'] / r['full']:>7.2f}{r['window'] / 2**20:>12.3f}")
        print(f"  {name:<14}{r['rate']:>8.2f}{spread:>16}{r['rate'] / base['rate']:>7.2f}{memory}{gather:>11}{wait:>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=["sd", "dit", "both"], default="both")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="requests submitted at once per measurement")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", help="a diffusers folder instead of the built-in tiny models")
    args = parser.parse_args()
    print(f"DLO bench: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, device cpu, gloo over loopback, one thread per rank, {args.steps} steps, "
          f"{args.requests} requests at once, {args.reps} reps")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            models = [("model", args.model, "a red fox")]
        else:
            from stage_runtime.models.tiny import make_tiny_model

            kinds = ["sd", "dit"] if args.kind == "both" else [args.kind]
            models = [(k, str(make_tiny_model(os.path.join(tmp, k), kind=k, seed=0)),
                       "a red fox" if k == "sd" else "207") for k in kinds]
        for kind, path, prompt in models:
            label = f"tiny-{kind}" if not args.model else path
            report(label, bench_model(kind, path, prompt, args.steps, args.requests, args.reps), args.reps)


if __name__ == "__main__":
    main()
