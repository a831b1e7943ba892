"""Mixed LoRA adapters in one step-mode tick vs one wave per adapter set, against the bare diffusers pipeline.

The workload is four requests with four adapter sets — base, a, b, a+b (random rank-4 PEFT adapters on the
tiny SD UNet and text encoder, written with diffusers' save_lora_weights). Three paths, interleaved in one
process with the order rotated each run:

- mixed:  the four admitted together into the engine (step mode, max_num_seqs=4): every tick is ONE UNet
          forward over all 16 rows (CFG doubled), each row with its own adapters;
- waves:  the same four, one wave per adapter set (what an adapter-set batch key forces): four requests
          one after the other through the same engine;
- bare:   diffusers' own way, ``set_adapters`` per set then a pipeline call, four calls in a row.

Prints per-run seconds (median, min–max, n), the per-run ratios mixed/waves and mixed/bare, and the machine.

    .venv/bin/python bench/lora.py [--runs 3] [--steps 10] [--size 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT), str(ROOT / "tests" / "stage_runtime")]

from stats import machine, ratio_summary, spread  # noqa: E402

SETS = {"base": (), "a": ({"name": "a", "scale": 0.8},), "b": ({"name": "b", "scale": 1.2},),
        "a+b": ({"name": "a", "scale": 0.5}, {"name": "b", "scale": 0.5})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    from lora_probes import load_pipe, write_adapter

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model
    from stage_runtime.request import DiffusionRequest, SamplingParams

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp())
    model = str(make_tiny_model(work / "tiny-sd", kind="sd"))
    files = {name: write_adapter(model, work / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}
    engine = DiffusionEngine.make_engine(load_config({
        "model": {"path": model}, "device": "cpu", "loras": [{"name": n, "path": p} for n, p in files.items()],
        "scheduler": {"execution_mode": "step", "max_num_seqs": 4}}))
    bare = load_pipe(model)
    for name, path in files.items():
        bare.load_lora_weights(path, adapter_name=name)

    def request(tag: str, i: int, loras) -> DiffusionRequest:
        return DiffusionRequest(f"{tag}-{i}-{time.monotonic_ns()}", "a photo of a cat", SamplingParams(
            num_inference_steps=args.steps, seed=i, height=args.size, width=args.size, loras=loras))

    def mixed() -> None:
        with engine._lock:                    # admitted together: they share every tick
            streams = [engine.add_request(request("mix", i, s)) for i, s in enumerate(SETS.values())]
        for s in streams:
            s.result(timeout=600)

    def waves() -> None:
        for i, s in enumerate(SETS.values()):
            engine.add_request(request("wave", i, s)).result(timeout=600)

    def bare_calls() -> None:
        for i, s in enumerate(SETS.values()):
            if s:
                bare.set_adapters([r["name"] for r in s], [r["scale"] for r in s])
            else:
                bare.disable_lora()
            bare(prompt=["a photo of a cat"], height=args.size, width=args.size, num_inference_steps=args.steps,
                 generator=[torch.Generator("cpu").manual_seed(i)], output_type="np")
            bare.enable_lora()

    paths = {"mixed": mixed, "waves": waves, "bare": bare_calls}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for fn in paths.values():                 # one untimed pass each
        fn()
    for run in range(args.runs):
        order = list(paths)[run % 3:] + list(paths)[:run % 3]
        for name in order:
            start = time.perf_counter()
            paths[name]()
            times[name].append(time.perf_counter() - start)
    engine.close()
    print(f"LoRA mixed tick vs one wave per adapter set: 4 requests (base, a, b, a+b), {args.steps} steps, "
          f"{args.size}x{args.size}, rank-4 adapters on UNet + text encoder; {args.runs} runs, interleaved")
    for name, values in times.items():
        print(f"  {name:6s} {spread(values, 's', 1.0, 3)}")
    print(f"  mixed / waves: {ratio_summary(times['mixed'], times['waves'])}")
    print(f"  mixed / bare:  {ratio_summary(times['mixed'], times['bare'])}")
    print(f"  waves / bare:  {ratio_summary(times['waves'], times['bare'])}")
    print(f"  machine: {machine()}")


if __name__ == "__main__":
    main()
