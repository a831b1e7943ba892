"""The compiled denoiser (docs/compile.md): its speed per denoising step, its compile time cold and warm, its
recompiles under a step-batched load, and what it draws — eager, ``regional`` and ``full`` side by side.

Part 1, the trained ``tiny-digits`` (a DiT: 5 blocks of 64 channels over 16 tokens; step mode, uni executor):

    compile time   per compiled mode, a child process warms a stage up on an EMPTY cache folder (cold), then
                   another on the same folder (warm): the seconds each warm-up spent compiling, the cache outcome
    per step       one process holds the three engines (the cache now warm); each round runs, in rotated order, b
                   requests of ``--steps`` steps on every engine (b = 1, 2, 4; guidance 4: 2 rows a request);
                   a step's time is the median tick of the round; ratio = compiled / eager per round
    recompiles     the mixed load of tests/stage_runtime/serve/test_http_compile.py (1-4 images a request, CFG
                   on then off, block-cache skips, a preemption, an abort) on each compiled engine: graphs after
                   warm-up
    quality        the ten digits (``--per-digit`` images each, seeds 0..) on each engine: the digit judge's score,
                   PSNR and the largest |diff| (uint8) against eager

Part 2, ``--families``: every tiny family at a tiny size (64x64; video 32x32x9, LTX-2 64x64x9), request mode, 1 and 4 requests a
wave: per step regional / eager and full / eager (medians of ``--runs`` rotated rounds) and a verdict — the faster
compiled mode when both its ratios are under 0.95, else none. ``--write-verdicts`` writes them into
stage_runtime/compilation/verdicts.json, what ``compile.mode: auto`` follows on this kind of device.

    .venv/bin/python bench/compile.py [--runs 3] [--steps 20] [--per-digit 4] [--json]
    .venv/bin/python bench/compile.py --families all [--write-verdicts]      # ~1 min a family here
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
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digit_quality import images, judge_score, psnr  # noqa: E402
from stats import machine, per_step  # noqa: E402
from stats import timed_engine as timed  # noqa: E402

MODES = ("none", "regional", "full")
BATCHES = (1, 2, 4)
VERDICT_BELOW = 0.95
VERDICTS = Path(__file__).resolve().parents[1] / "stage_runtime" / "compilation" / "verdicts.json"


def make_engine(path: str, mode: str, cache_dir: str, execution_mode: str = "step", shapes: tuple = (),
                max_num_seqs: int = 8, **extra):
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine

    config = {"model": {"path": path}, "device": "cpu", "executor": "uni",
              "scheduler": {"execution_mode": execution_mode, "max_num_seqs": max_num_seqs,
                            "scheduling_policy": "priority"}, **extra}
    if mode != "none":
        config["compile"] = {"mode": mode, "cache_dir": cache_dir, "shapes": list(shapes)}
    return DiffusionEngine.make_engine(load_config(config))


def digit_requests(tag: str, b: int, steps: int):
    from stage_runtime.request import DiffusionRequest, SamplingParams

    return [DiffusionRequest(f"{tag}-{i}", str(i % 10), SamplingParams(num_inference_steps=steps, seed=i))
            for i in range(b)]


def mixed_load(engine) -> None:
    """The test's mixed load, in process: 8 long requests (1-4 images, half with the block cache), a preempting one,
    an aborted one, then two unguided ones."""
    from stage_runtime.request import DiffusionRequest, RequestCache, SamplingParams

    def req(rid, prompt, **kw):
        return DiffusionRequest(rid, prompt, SamplingParams(seed=len(rid), **kw))

    low = [engine.add_request(req(f"low-{i}", str(i), num_outputs=1 + i % 4, num_inference_steps=60 - 5 * i,
                                  cache=RequestCache(threshold=1.0) if i % 2 else None)) for i in range(8)]
    high = engine.add_request(req("high", "7", num_outputs=2, priority=5, num_inference_steps=12))
    doomed = engine.add_request(req("doomed", "1", priority=9, num_inference_steps=900))
    engine.abort(["doomed"])
    plain = [engine.add_request(req(f"plain-{n}", "4", num_outputs=n, guidance_scale=1.0, num_inference_steps=9))
             for n in (1, 3)]
    for stream in [*low, high, *plain]:
        stream.result(timeout=900)
    try:
        doomed.result(timeout=900)
    except Exception:  # noqa: BLE001 - aborted, as asked
        pass


def child_compile_time(path: str, mode: str, cache_dir: str, execution_mode: str, shapes: list[str]) -> dict:
    """One warm-up on ``cache_dir``: the rank's compile stats at its end and the seconds to ready."""
    start = time.perf_counter()
    engine = make_engine(path, mode, cache_dir, execution_mode, tuple(shapes))
    try:
        stats = engine.compile_warmup_stats[0]
        return {**stats, "ready_s": round(time.perf_counter() - start, 2)}
    finally:
        engine.close()


def compile_times(path: str, mode: str, cache: str, execution_mode: str = "step", shapes: tuple = ()) -> tuple:
    """(cold, warm) warm-ups of ``mode`` in child processes on ``cache`` (which holds no graph of ``mode`` yet)."""
    runs = []
    for _ in ("cold", "warm"):
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps([path, mode, cache, execution_mode,
                                                                                list(shapes)])],
                             capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs[0], runs[1]


def digits_part(args) -> dict:
    from stage_runtime.models.tiny.digits import FOLDER

    path = str(FOLDER)
    result: dict = {"model": "tiny-digits (trained DiT, 5 blocks x 64 channels, 16 tokens)", "steps": args.steps,
                    "runs": args.runs}
    cache = tempfile.mkdtemp(prefix="compile-bench-")        # regional's graphs, then full's: the engines below warm
    try:
        return _digits_part(args, path, result, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _digits_part(args, path: str, result: dict, cache: str) -> dict:
    for mode in MODES[1:]:
        cold, warm = compile_times(path, mode, cache)
        result[mode] = {"cold_compile_s": cold["cold_compile_s"], "warm_compile_s": warm["cold_compile_s"],
                        "cold_ready_s": cold["ready_s"], "warm_ready_s": warm["ready_s"], "graphs": cold["graphs"],
                        "cache_cold": cold["cache"], "cache_warm": warm["cache"]}
        print(f"{mode}: compile cold {cold['cold_compile_s']:.1f} s ({cold['cache']}), warm "
              f"{warm['cold_compile_s']:.1f} s ({warm['cache']}), {cold['graphs']} graphs", file=sys.stderr, flush=True)
    engines = {mode: timed(make_engine(path, mode, cache)) for mode in MODES}
    try:
        times = {(mode, b): [] for mode in MODES for b in BATCHES}
        for mode in MODES:                               # every batch size once first (first-call set-up)
            for b in BATCHES:
                per_step(engines[mode], digit_requests(f"w-{b}", b, 3))
        for run in range(args.runs):
            for b in BATCHES:
                order = MODES[run % 3:] + MODES[:run % 3]
                for mode in order:
                    times[(mode, b)].append(per_step(engines[mode], digit_requests(f"t{run}-{b}", b, args.steps)))
        for mode in MODES[1:]:
            for b in BATCHES:
                ratios = [c / e for c, e in zip(times[(mode, b)], times[("none", b)], strict=True)]
                result[mode][f"ratio_b{b}"] = round(statistics.median(ratios), 3)
                result[mode][f"ratio_b{b}_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
                result[mode][f"step_ms_b{b}"] = round(statistics.median(times[(mode, b)]) * 1e3, 3)
            result[mode]["eager_step_ms"] = {f"b{b}": round(statistics.median(times[("none", b)]) * 1e3, 3)
                                             for b in BATCHES}
            graphs = engines[mode].collective_rpc("compile_stats")[0]["graphs"]
            mixed_load(engines[mode])
            after = engines[mode].collective_rpc("compile_stats")[0]
            result[mode]["recompiles_after_warmup"] = after["recompiles"]
            assert after["graphs"] - graphs == after["recompiles"]
        drawn = {mode: images(_draw(engines[mode], args.per_digit)) for mode in MODES}
        result["judge_eager"] = round(judge_score(drawn["none"]), 4)
        for mode in MODES[1:]:
            result[mode]["judge"] = round(judge_score(drawn[mode]), 4)
            result[mode]["psnr_vs_eager_db"] = round(psnr(drawn[mode], drawn["none"]), 2)
            result[mode]["max_uint8_diff"] = max(int(abs(drawn[mode][d].astype(int) - drawn["none"][d].astype(int))
                                                     .max()) for d in drawn["none"])
    finally:
        for engine in engines.values():
            engine.close()
    return result


def _draw(engine, per_digit: int) -> dict:
    from digit_quality import draw_digits

    return draw_digits(engine, "digits", per_digit)


# -- part 2: every family at a tiny size ------------------------------------------------------------------------
def family_requests(info, tag: str, b: int, steps: int, size: int):
    import numpy as np

    from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

    frames = 9 if info.video else None
    side = video_side(info) if info.video else size
    grey = np.full((side, side, 3), 128, dtype=np.uint8)
    return [DiffusionRequest(f"{tag}-{i}", "a red cube on a table", SamplingParams(
        num_inference_steps=steps, seed=i, height=None if info.fixed_size else side,
        width=None if info.fixed_size else side, num_frames=frames), video=info.video,
        reference=grey if info.reference == "required" else None, edit=EditInput(grey) if info.edits_only else None)
        for i in range(b)]


def video_side(info) -> int:
    """A video family's tiny frame side: 32, or the least it takes (LTX-2: two latent pixels of 32)."""
    return max(32, 2 * info.size_multiple)


def child_family(kind: str, runs: int, steps: int, size: int) -> dict:
    root = tempfile.mkdtemp(prefix="compile-bench-family-")
    try:
        return _child_family(kind, runs, steps, size, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _child_family(kind: str, runs: int, steps: int, size: int, root: str) -> dict:
    from stage_runtime.models.tiny import make_tiny_model

    path = str(make_tiny_model(Path(root) / kind, kind=kind))
    cache = str(Path(root) / "cache")
    engines, out = {}, {"kind": kind}
    for mode in MODES:
        start = time.perf_counter()
        try:
            probe = make_engine(path, "none", cache, "request", max_num_seqs=4) if mode == "none" else None
            info = (probe or engines["none"]).model_info
            side = video_side(info) if info.video else size
            shape = () if info.fixed_size else (f"{side}x{side}" + ("x9" if info.video else ""),)
            engines[mode] = timed(probe or make_engine(path, mode, cache, "request", shape, max_num_seqs=4))
            stats = engines[mode].compile_warmup_stats
            out[mode] = {"ready_s": round(time.perf_counter() - start, 1)}
            if stats:
                out[mode].update(compile_s=stats[0]["cold_compile_s"], graphs=stats[0]["graphs"],
                                 effective=stats[0]["mode_effective"], reason=stats[0]["reason"])
        except Exception as exc:  # noqa: BLE001 - a family that cannot compile is a verdict, not a crash
            out[mode] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    out["pipeline_class"] = engines["none"].model_info.pipeline_class
    usable = ["none"] + [m for m in MODES[1:] if out[m].get("effective") == m]     # compiled, no fallback
    times = {(m, b): [] for m in usable for b in (1, 4)}
    for mode in usable:                                  # first-call set-up out of the way
        for b in (1, 4):
            per_step(engines[mode], family_requests(engines["none"].model_info, f"w-{b}-{mode}", b, 2, size))
    for run in range(runs):
        for b in (1, 4):
            for mode in usable[run % len(usable):] + usable[:run % len(usable)]:
                requests = family_requests(engines["none"].model_info, f"r{run}-{b}-{mode}", b, steps, size)
                times[(mode, b)].append(per_step(engines[mode], requests))
    for mode in usable[1:]:
        for b in (1, 4):
            out[mode][f"ratio_b{b}"] = round(statistics.median(
                [c / e for c, e in zip(times[(mode, b)], times[("none", b)], strict=True)]), 3)
    candidates = [(max(out[m]["ratio_b1"], out[m]["ratio_b4"]), m) for m in usable[1:]]
    best = min(candidates, default=(1.0, "none"))
    out["verdict"] = best[1] if best[0] < VERDICT_BELOW else "none"
    out["eager_step_ms_b1"] = round(statistics.median(times[("none", 1)]) * 1e3, 2)
    for engine in engines.values():
        engine.close()
    return out


def families_part(args) -> dict:
    from stage_runtime.model_catalog import tiny_kinds

    kinds = [k for k in tiny_kinds() if k != "digits"] if args.families == "all" else args.families.split(",")
    results = {}
    for kind in kinds:
        proc = subprocess.run([sys.executable, __file__, "--child-family",
                               json.dumps([kind, args.runs, args.family_steps, args.size])],
                              capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            results[kind] = {"kind": kind, "error": proc.stderr.strip().splitlines()[-1:], "verdict": "none"}
        else:
            results[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
        row = results[kind]
        ratios = "  ".join(f"{m} b1 {row.get(m, {}).get('ratio_b1', '-')} b4 {row.get(m, {}).get('ratio_b4', '-')}"
                           for m in MODES[1:])
        print(f"{kind:22s} {row.get('pipeline_class', '?'):38s} {ratios}  verdict {row['verdict']}", file=sys.stderr,
              flush=True)
    return results


def write_verdicts(families: dict, source: str) -> None:
    table = json.loads(VERDICTS.read_text()) if VERDICTS.exists() else {}
    rows = table.setdefault("cpu", {})
    for row in families.values():
        if "pipeline_class" not in row:
            continue
        rows[row["pipeline_class"]] = {"mode": row["verdict"], "source": source, "kind": f"tiny-{row['kind']}",
                                       "ratios": {
            f"{m} b{b}": row[m][f"ratio_b{b}"] for m in MODES[1:] for b in (1, 4) if f"ratio_b{b}" in row.get(m, {})}}
    VERDICTS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--per-digit", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object (the keys docs/compile.md lists)")
    p.add_argument("--families", default=None, help="'all' or kinds, comma-separated: part 2")
    p.add_argument("--family-steps", type=int, default=8)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--no-digits", action="store_true", help="part 2 only")
    p.add_argument("--write-verdicts", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-family", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child_compile_time(*json.loads(args.child))))
        return 0
    if args.child_family:
        print(json.dumps(child_family(*json.loads(args.child_family))))
        return 0
    out: dict = {"machine": machine(), "threads": args.threads}
    if not args.no_digits:
        digits = digits_part(args)
        regional, full = digits["regional"], digits["full"]
        out.update(ratio_b1=regional["ratio_b1"], ratio_b2=regional["ratio_b2"], ratio_b4=regional["ratio_b4"],
                   full_ratio_b1=full["ratio_b1"], full_ratio_b2=full["ratio_b2"], full_ratio_b4=full["ratio_b4"],
                   recompiles_after_warmup=max(regional["recompiles_after_warmup"], full["recompiles_after_warmup"]),
                   cold_compile_s=regional["cold_compile_s"], warm_compile_s=regional["warm_compile_s"],
                   max_uint8_diff=max(regional["max_uint8_diff"], full["max_uint8_diff"]),
                   judge_eager=digits["judge_eager"], judge_compiled=regional["judge"], judge_full=full["judge"],
                   digits=digits)
    if args.families:
        out["families"] = families_part(args)
        if args.write_verdicts:
            write_verdicts(out["families"], f"bench/compile.py {time.strftime('%Y-%m-%d')}, {machine().split(';')[0]}")
    out["machine"] = machine()
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
