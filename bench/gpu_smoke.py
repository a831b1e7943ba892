"""GPU smoke: NCCL groups, CFG / Ulysses / ring / TP equality and speedups on the GPUs of one machine (< 5 min).

Needs at least 2 CUDA GPUs; otherwise it prints SKIP and the reason and exits 0 (as it does here, on CPU). One GPU
is what ``bench/gpu_check.py`` checks (part 2 runs these plans with every rank on that GPU: no speedup). Per
topology (every one of them on 2 GPUs; Ulysses 2 × ring 2 and TP 2 × CFG 2 too when 4 GPUs are present):

1. equality: tiny DiT and tiny SD3 (the test models), a fused request-mode call of two requests and a
   step-mode batch of two, each rank's images against one plain rank's (max |diff| <= 2 uint8);
2. speed: one forward of a DiT-XL-sized transformer (28 blocks, 1152 wide, 16 heads; 4096 tokens, batch 2,
   float16, random weights built locally) — median of N timed calls after warm-up, vs one GPU measured in
   the same run; the ratio is the speedup.

The rank processes, plans and scenario are the GPU check's (``gpucheck/ranks.py``): one rank per GPU, NCCL.

    .venv/bin/python bench/gpu_smoke.py [--iters 10] [--gloo]     # --gloo: the same on 2 CPU processes (no speedup)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpucheck.ranks import PLANS_2, PLANS_4, TOLERANCE, errors, launch, load_adapter, parallel_config  # noqa: E402
from gpucheck.ranks import scenario_images, worst_diff  # noqa: E402

# DiT-XL/2 at 1024 px (GPU); a small stand-in for --gloo on CPU
SIZES = {"gpu": {"num_attention_heads": 16, "attention_head_dim": 72, "num_layers": 28, "sample_size": 128},
         "cpu": {"num_attention_heads": 4, "attention_head_dim": 16, "num_layers": 2, "sample_size": 32}}


def big_adapter(device):
    """A DiTAdapter over a DiTPipeline whose transformer is DiT-XL-sized (random weights, built here)."""
    import torch
    from diffusers import DiTPipeline, DiTTransformer2DModel

    from stage_runtime.models.families.dit import DiTAdapter
    from stage_runtime.models.tiny.common import ddim_scheduler, tiny_vae

    cpu = device.type == "cpu"
    torch.manual_seed(0)
    model = DiTTransformer2DModel(in_channels=4, out_channels=8, patch_size=2, norm_type="ada_norm_zero",
                                  **SIZES["cpu" if cpu else "gpu"])
    model = model.to(device=device, dtype=torch.float32 if cpu else torch.float16).eval()
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


def timed_big_forward(rank, device, groups, parallel, job) -> list[float]:
    """The rank's extra job (``gpucheck.ranks.model_ranks``): the DiT-XL forward under the plan, timed."""
    from stage_runtime.distributed.apply import apply_parallelism

    big = big_adapter(device)
    apply_parallelism(big, groups, parallel)
    return time_forward(big.denoiser, device, job["iters"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--gloo", action="store_true", help="run on 2 CPU processes over gloo (checks the script)")
    args = ap.parse_args()
    import torch

    from stage_runtime.models.tiny import make_tiny_model

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 and not args.gloo:
        print(f"SKIP: the GPU smoke needs at least 2 CUDA GPUs (found {gpus}; torch {torch.__version__}); "
              "nothing was run. `--gloo` runs the same checks on 2 CPU processes; one GPU: bench/gpu_check.py.")
        return 0
    world_max = 2 if args.gloo else min(gpus, 4)
    root = tempfile.mkdtemp(prefix="ds-gpu-smoke-")
    models = {kind: str(make_tiny_model(f"{root}/{kind}", kind=kind)) for kind in ("dit", "sd3")}
    device = torch.device("cpu") if args.gloo else torch.device("cuda", 0)
    references = {kind: scenario_images(load_adapter(p, device)) for kind, p in models.items()}
    big = big_adapter(device).denoiser
    base = statistics.median(time_forward(big, device, args.iters))
    tokens = (big.config.sample_size // 2) ** 2
    del big
    print(f"# GPU smoke — {gpus} GPU(s){' (gloo on CPU)' if args.gloo else ''}, torch {torch.__version__}; "
          f"1 rank: {base:.1f} ms per DiT forward ({tokens} tokens, batch 2)")
    failures = 0
    plans = {**PLANS_2, **(PLANS_4 if world_max >= 4 else {})}
    for name, plan in plans.items():
        world = parallel_config(plan).world_size
        started = time.monotonic()
        job = {"plan": plan, "models": models, "placement": "cpu" if args.gloo else "own", "iters": args.iters,
               "extra": "gpu_smoke:timed_big_forward"}
        outcome = launch(world, job, timeout_s=240.0)
        if problems := errors(outcome):
            failures += 1
            print(f"{name:>20}  FAILED  " + "; ".join(problems))
            continue
        worst = worst_diff(outcome, references)
        ms = outcome[0][1]["extra"]
        failures += worst > TOLERANCE
        print(f"{name:>20}  images max|diff| {worst} ({'ok' if worst <= TOLERANCE else 'FAIL'})  "
              f"{statistics.median(ms):8.1f} ms [{min(ms):.1f}–{max(ms):.1f}, n={args.iters}]  "
              f"speedup {base / statistics.median(ms):4.2f}x on {world} ranks  ({time.monotonic() - started:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
