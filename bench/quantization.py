"""Quantized weights and what they cost in quality (docs/quantization.md): per method, on the trained ``tiny-digits``
(a DiT: 5 blocks of 64 channels) and, PSNR only, on every tiny random family.

Part 1, tiny-digits, one process holding an engine per method (uni executor, step mode, float32 compute):

    judge_accuracy              the digit judge's share of 100 digits (10 per class, seeds 0..9) read as asked
    psnr_db, max_uint8_diff     against the unquantized engine's images of the same requests
    weight_bytes_ratio_vs_bf16  the denoiser's bytes quantized ÷ unquantized, both loaded in bfloat16 (what the issue
                                compares: in float32 the layers each method keeps weigh twice as much);
                                ``..._vs_float32`` the same as served here
    step_time_ratio             a denoising step of 1 and of 4 requests, quantized ÷ unquantized, the engines measured
                                in rotated rounds (median of ``--runs`` rounds; min–max beside it)

``fp8`` is refused on this CPU (its message is the row). Part 2 (``--families``): every tiny family, request mode,
one 8-step request at 64x64 (video 32x32x9; LTX-2 64x64x9): PSNR and max |diff| of each method against the
unquantized pipeline, and the denoiser's bytes ratio — random weights draw noise, so there is no quality signal
beyond "how far from the unquantized numbers".

    .venv/bin/python bench/quantization.py [--runs 5] [--json] [--families all]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digit_quality import draw_digits, images, judge_score, max_diff, psnr  # noqa: E402
from stats import machine, per_step, timed_engine  # noqa: E402

METHODS = ("none", "fp8-storage", "int8-weight", "fp8")


def make_engine(path: str, method: str, execution_mode: str = "step", max_num_seqs: int = 10):
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine

    return DiffusionEngine.make_engine(load_config({
        "model": {"path": path}, "device": "cpu", "executor": "uni",
        "scheduler": {"execution_mode": execution_mode, "max_num_seqs": max_num_seqs},
        "quantization": {"method": method}}))


def bf16_ratio(path: str, method: str) -> float:
    """The denoiser's bytes, quantized ÷ unquantized, loaded in bfloat16."""
    from stage_runtime.config import load_config
    from stage_runtime.models.registry import resolve_adapter_class
    from stage_runtime.quantization import quantize

    import torch

    config = load_config({"model": {"path": path, "dtype": "bfloat16"}, "device": "cpu",
                          "quantization": {"method": method}})
    adapter = resolve_adapter_class(config.model).load(path, torch.device("cpu"), "bfloat16")
    report = quantize(adapter, config, torch.device("cpu"))
    names = list(adapter.block_holders())
    return sum(report.components[n]["bytes"] for n in names) / sum(
        report.components[n].get("bytes_as_loaded", report.components[n]["bytes"]) for n in names)


def digit_requests(tag: str, b: int, steps: int = 20):
    from stage_runtime.request import DiffusionRequest, SamplingParams

    return [DiffusionRequest(f"{tag}-{i}", str(i % 10), SamplingParams(num_inference_steps=steps, seed=i))
            for i in range(b)]


def digits_part(args) -> dict:
    from stage_runtime.errors import ConfigError
    from stage_runtime.models.tiny.digits import FOLDER

    path, rows, engines = str(FOLDER), {}, {}
    for method in METHODS:
        try:
            engines[method] = timed_engine(make_engine(path, method))
        except ConfigError as exc:
            rows[method] = {"refused": str(exc)}
    try:
        usable = list(engines)
        times = {(m, b): [] for m in usable for b in (1, 4)}
        for m in usable:
            for b in (1, 4):
                per_step(engines[m], digit_requests(f"w{m}{b}", b, 3))          # first-call set-up
        for run in range(args.runs):
            for b in (1, 4):
                for m in usable[run % len(usable):] + usable[:run % len(usable)]:
                    times[(m, b)].append(per_step(engines[m], digit_requests(f"t{run}{b}", b)))
        drawn = {m: images(draw_digits(engines[m], m, args.per_digit)) for m in usable}
        for m in usable:
            weights = engines[m].weights[0]["components"]["transformer"]
            row = rows[m] = {"judge_accuracy": round(judge_score(drawn[m]), 4), "images": 10 * args.per_digit}
            if m == "none":
                continue
            row.update(psnr_db=round(psnr(drawn[m], drawn["none"]), 2),
                       max_uint8_diff=max_diff(drawn[m], drawn["none"]),
                       weight_bytes_ratio_vs_bf16=round(bf16_ratio(path, m), 3),
                       weight_bytes_ratio_vs_float32=round(weights["bytes"] / weights["bytes_as_loaded"], 3),
                       layers_quantized=weights["layers_quantized"])
            for b in (1, 4):
                ratios = [q / e for q, e in zip(times[(m, b)], times[("none", b)], strict=True)]
                row[f"step_time_ratio_b{b}"] = round(statistics.median(ratios), 3)
                row[f"step_time_ratio_b{b}_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
            row["step_time_ratio"] = row["step_time_ratio_b1"]
        rows["none"]["step_ms_b1"] = round(statistics.median(times[("none", 1)]) * 1e3, 3)
    finally:
        for engine in engines.values():
            engine.close()
    return rows


def family_requests(info, size: int):
    import numpy as np

    from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

    side = max(32, 2 * info.size_multiple) if info.video else size
    grey = np.full((side, side, 3), 128, dtype=np.uint8)
    return [DiffusionRequest("q", "a red cube on a table", SamplingParams(
        num_inference_steps=8, seed=3, height=None if info.fixed_size else side,
        width=None if info.fixed_size else side, num_frames=9 if info.video else None), video=info.video,
        reference=grey if info.reference == "required" else None, edit=EditInput(grey) if info.edits_only else None)]


def child_family(kind: str, size: int) -> dict:
    import numpy as np

    from stage_runtime.models.tiny import make_tiny_model

    root = tempfile.mkdtemp(prefix="quant-bench-")
    try:
        path = str(make_tiny_model(Path(root) / kind, kind=kind))
        out, base = {"kind": kind}, None
        for method in METHODS[:3]:
            engine = make_engine(path, method, "request", 1)
            try:
                result = engine.add_request(family_requests(engine.model_info, size)[0]).result(timeout=900).images
                out["pipeline_class"] = engine.model_info.pipeline_class
                denoisers = [c for c in engine.weights[0]["components"].values() if c["method"] != "none"]
            finally:
                engine.close()
            if method == "none":
                base = result
                continue
            diff = np.abs(result.astype(int) - base.astype(int))
            mse = float((diff.astype(float) ** 2).mean())
            out[method] = {"psnr_db": round(10 * np.log10(255 ** 2 / mse), 2) if mse else float("inf"),
                           "max_uint8_diff": int(diff.max()),
                           "weight_bytes_ratio_vs_float32": round(sum(c["bytes"] for c in denoisers) / sum(
                               c["bytes_as_loaded"] for c in denoisers), 3)}
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def families_part(args) -> dict:
    from stage_runtime.model_catalog import tiny_kinds

    kinds = list(tiny_kinds()) if args.families == "all" else args.families.split(",")
    results = {}
    for kind in kinds:
        proc = subprocess.run([sys.executable, __file__, "--child-family", json.dumps([kind, args.size])],
                              capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        results[kind] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {
            "kind": kind, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        row = results[kind]
        print(f"{kind:22s} " + "  ".join(f"{m}: PSNR {row[m]['psnr_db']} dB, max|diff| {row[m]['max_uint8_diff']}, "
                                         f"bytes {row[m]['weight_bytes_ratio_vs_float32']}x" for m in METHODS[1:3]
                                         if m in row) + (f"  error {row['error']}" if "error" in row else ""),
              file=sys.stderr, flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--per-digit", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--families", default=None, help="'all' or tiny kinds, comma-separated: part 2")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--no-digits", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--child-family", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.child_family:
        print(json.dumps(child_family(*json.loads(args.child_family))))
        return 0
    out: dict = {"threads": args.threads}
    if not args.no_digits:
        out["methods"] = digits_part(args)
    if args.families:
        out["families"] = families_part(args)
    out["machine"] = machine()
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
