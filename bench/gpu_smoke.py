"""GPU smoke: NCCL groups, CFG / Ulysses / ring / TP equality and speedups on the GPUs of one machine (< 5 min).

Needs at least 2 CUDA GPUs; otherwise it prints SKIP and the reason and exits 0 (as it does here, on CPU).
Per topology (every one of them on 2 GPUs; Ulysses 2 × ring 2 and TP 2 × CFG 2 too when 4 GPUs are present):

1. equality: tiny DiT and tiny SD3 (the test models), a fused request-mode call of two requests and a
   step-mode batch of two, each rank's images against one plain rank's (max |diff| <= 2 uint8);
2. speed: one forward of a DiT-XL-sized transformer (28 blocks, 1152 wide, 16 heads; 4096 tokens, batch 2,
   float16, random weights built locally) — median of N timed calls after warm-up, vs one GPU measured in
   the same run; the ratio is the speedup.

    .venv/bin/python bench/gpu_smoke.py [--iters 10] [--gloo]     # --gloo: the same on 2 CPU processes (no speedup)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOLERANCE = 2
PLANS_2 = {"cfg 2": {"cfg_parallel_size": 2}, "ulysses 2": {"ulysses_degree": 2}, "ring 2": {"ring_degree": 2},
           "tp 2": {"tensor_parallel_size": 2}}
PLANS_4 = {"ulysses 2 x ring 2": {"ulysses_degree": 2, "ring_degree": 2},
           "tp 2 x cfg 2": {"tensor_parallel_size": 2, "cfg_parallel_size": 2}}


def _parallel(fields: dict):
    from stage_runtime.config import ParallelConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # tp without ulysses warns
        return ParallelConfig(**fields)


def _device(rank: int, gloo: bool):
    import torch

    return torch.device("cpu") if gloo else torch.device("cuda", rank)


def images(adapter) -> dict:
    """Request mode (two requests fused) and step mode (two requests batched) at the default guidance."""
    import torch

    from stage_runtime.request import DiffusionRequest, SamplingParams

    def req(rid, prompt, seed):
        sampling = SamplingParams(num_inference_steps=3, seed=seed, height=64, width=64)
        return DiffusionRequest(rid, prompt, sampling).resolve(adapter.info())

    out = {}
    with torch.inference_mode():
        out.update({f"request/{k}": v for k, v in adapter.run_batch([req("a", "17", 1), req("b", "red", 2)]).items()})
        states = [adapter.prepare_encode(r) for r in (req("c", "3", 3), req("d", "cat", 4))]
        while active := [st for st in states if not st.finished]:
            for st, pred in zip(active, adapter.denoise_step(active), strict=True):
                adapter.noise_step(st, pred)
        out.update({f"step/{st.request_id}": adapter.post_decode(st) for st in states})
    return out


# DiT-XL/2 at 1024 px (GPU); a small stand-in for --gloo on CPU
SIZES = {"gpu": {"num_attention_heads": 16, "attention_head_dim": 72, "num_layers": 28, "sample_size": 128},
         "cpu": {"num_attention_heads": 4, "attention_head_dim": 16, "num_layers": 2, "sample_size": 32}}


def big_adapter(device, gloo: bool):
    """A DiTAdapter over a DiTPipeline whose transformer is DiT-XL-sized (random weights, built here)."""
    import torch
    from diffusers import DiTPipeline, DiTTransformer2DModel

    from stage_runtime.models.dit import DiTAdapter
    from stage_runtime.models.tiny.common import ddim_scheduler, tiny_vae

    torch.manual_seed(0)
    model = DiTTransformer2DModel(in_channels=4, out_channels=8, patch_size=2, norm_type="ada_norm_zero",
                                  **SIZES["cpu" if gloo else "gpu"])
    model = model.to(device=device, dtype=torch.float32 if gloo else torch.float16).eval()
    return DiTAdapter(DiTPipeline(transformer=model, vae=tiny_vae().to(device), scheduler=ddim_scheduler()), device)


def time_forward(model, device, iters: int) -> list[float]:
    import torch

    side = model.config.sample_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 4, side, side, generator=gen).to(device=device, dtype=next(model.parameters()).dtype)
    t, labels = torch.tensor([500, 500], device=device), torch.tensor([1, 2], device=device)
    times = []
    with torch.inference_mode():
        for i in range(iters + 2):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(x, timestep=t, class_labels=labels)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times.append((time.perf_counter() - start) * 1e3)
    return times


def _rank(rank, world, plan, models, rendezvous, iters, gloo, results) -> None:
    import torch

    from stage_runtime.config import ModelConfig
    from stage_runtime.distributed.apply import apply_parallelism
    from stage_runtime.distributed.groups import destroy_distributed, init_distributed
    from stage_runtime.models.registry import resolve_adapter_class

    torch.set_num_threads(1)
    device, parallel = _device(rank, gloo), _parallel(plan)
    try:
        groups = init_distributed(parallel, rank, rendezvous, device, 120.0)
        try:
            out = {}
            for kind, path in models.items():
                adapter = resolve_adapter_class(ModelConfig(path=path)).load(path, device)
                apply_parallelism(adapter, groups, parallel)
                out[kind] = images(adapter)
            big = big_adapter(device, gloo)
            apply_parallelism(big, groups, parallel)
            out["ms"] = time_forward(big.denoiser, device, iters)
        finally:
            destroy_distributed()
        results.put((rank, "ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))


def run_world(world, plan, models, iters, gloo) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ds-gpu-smoke-") as folder:
        procs = [ctx.Process(target=_rank, args=(r, world, plan, models, f"file://{folder}/rdv", iters, gloo,
                                                 results)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            return {rank: (status, out) for rank, status, out in (results.get(timeout=240) for _ in procs)}
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--gloo", action="store_true", help="run on 2 CPU processes over gloo (checks the script)")
    args = ap.parse_args()
    import numpy as np
    import torch

    from stage_runtime.config import ModelConfig
    from stage_runtime.models.registry import resolve_adapter_class
    from stage_runtime.models.tiny import make_tiny_model

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 and not args.gloo:
        print(f"SKIP: the GPU smoke needs at least 2 CUDA GPUs (found {gpus}; torch {torch.__version__}); "
              "nothing was run. `--gloo` runs the same checks on 2 CPU processes.")
        return 0
    world_max = 2 if args.gloo else min(gpus, 4)
    root = tempfile.mkdtemp(prefix="ds-gpu-smoke-")
    models = {kind: str(make_tiny_model(f"{root}/{kind}", kind=kind)) for kind in ("dit", "sd3")}
    device = _device(0, args.gloo)
    references = {kind: images(resolve_adapter_class(ModelConfig(path=p)).load(p, device))
                  for kind, p in models.items()}
    big = big_adapter(device, args.gloo).denoiser
    base = statistics.median(time_forward(big, device, args.iters))
    tokens = (big.config.sample_size // 2) ** 2
    del big
    print(f"# GPU smoke — {gpus} GPU(s){' (gloo on CPU)' if args.gloo else ''}, torch {torch.__version__}; "
          f"1 rank: {base:.1f} ms per DiT forward ({tokens} tokens, batch 2)")
    failures = 0
    plans = {**PLANS_2, **(PLANS_4 if world_max >= 4 else {})}
    for name, plan in plans.items():
        world = _parallel(plan).world_size
        started = time.monotonic()
        outcome = run_world(world, plan, models, args.iters, args.gloo)
        errors = [f"rank {r}: {out}" for r, (status, out) in outcome.items() if status != "ok"]
        if errors:
            failures += 1
            print(f"{name:>20}  FAILED  " + "; ".join(errors))
            continue
        worst = max(int(np.abs(out[kind][k].astype(np.int16) - references[kind][k].astype(np.int16)).max())
                    for _, out in outcome.values() for kind in models for k in references[kind])
        ms = statistics.median(outcome[0][1]["ms"])
        failures += worst > TOLERANCE
        print(f"{name:>20}  images max|diff| {worst} ({'ok' if worst <= TOLERANCE else 'FAIL'})  "
              f"{ms:8.1f} ms [{min(outcome[0][1]['ms']):.1f}–{max(outcome[0][1]['ms']):.1f}, n={args.iters}]  "
              f"speedup {base / ms:4.2f}x on {world} ranks  ({time.monotonic() - started:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
