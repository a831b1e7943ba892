"""GPU check: one CUDA device, under eight minutes — the CUDA paths proved and real-size throughput measured.

    make gpu-check                               # = .venv/bin/python bench/gpu_check.py
    .venv/bin/python bench/gpu_check.py --cpu-dry-run        # every part on CPU: float32, toy sizes, gloo

Parts (docs/testing.md, "The GPU check"), each in a child process with a time budget; a part's rows are kept as
soon as it has them, and the JSON report (with the table beside it) is rewritten after every part:

1. correctness on CUDA: every served family (tiny models) in bfloat16 and float16, request and step mode, against
   the bare diffusers call on the same device; model and layerwise offload to the host and disk tiers bitwise
   equal to no offload; a preempted request parked in host memory resumes bitwise; an ``mp`` rank forked from the
   fork server initialises CUDA (or which start method worked instead, and why);
2. parallel code paths on one GPU: CFG, Ulysses, ring and TP on 2 and 4 ranks sharing cuda:0 (NCCL if it takes
   two ranks on one device, else gloo with CUDA tensors), equal to one rank within 2 uint8;
3. real-size throughput with random weights built on the device: FLUX.1-dev-sized at 1024², Wan-2.1-1.3B-sized at
   480x832x81, SDXL-sized at 1024² — engine vs bare, step-mode batches of 2 and 4 vs sequential, peak memory, the
   denoiser compiled regional (FLUX and Wan: cold and warm compile seconds, compiled ÷ eager per tick, recompiles
   under the batches), FLUX's weights in int8-weight and fp8 (bytes, step time against unquantized), the offload
   tiers' step time, each next to the published anchors;
4. hygiene: one GPU only, offline, every process and /dev/shm segment of every part gone (swept and reported if
   not); the report names the GPU, driver, torch and CUDA versions.

Without CUDA (and without --cpu-dry-run) it prints SKIP with the reason and exits 0. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
os.environ.update(OFFLINE)

from gpucheck.families import uncovered  # noqa: E402
from gpucheck.ranks import PLANS_2, PLANS_4  # noqa: E402
from gpucheck.report import FAILING, Row, anchors_section, environment, format_row, read_rows, table  # noqa: E402
from gpucheck.sizes import MODELS  # noqa: E402
from gpucheck.target import DTYPES  # noqa: E402
from stage_runtime.model_catalog import tiny_kinds  # noqa: E402

# seconds per part: (on a GPU, in the dry run). The sums bound the whole run (< 8 min on a GPU, < 3 min dry) unless a
# part hangs: a part still running GRACE_S after its budget is killed.
BUDGETS = {1: (130.0, 90.0), 2: (80.0, 50.0), 3: (230.0, 35.0)}
AFTER_FAMILIES_S = (40.0, 32.0)     # part 1's time kept for offload, preemption and the fork server's rank
GRACE_S = 20.0
PARTS = (1, 2, 3)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="every part on CPU: float32, toy sizes, gloo")
    ap.add_argument("--parts", default="1,2,3", help="which of parts 1-3 to run (part 4 always runs), e.g. 1,3")
    ap.add_argument("--json", default=".gpu-check/report.json", help="where the JSON report goes")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    ap.add_argument("--grace-s", type=float, default=GRACE_S, help="a part still running this long after its "
                    "budget is killed")
    ap.add_argument("--dtypes", default="bfloat16,float16", help="part 1's dtypes on the GPU")
    ap.add_argument("--families", default="", help="part 1: only these tiny kinds (default: every served one)")
    ap.add_argument("--parallel-dtype", default="float32", help="part 2's dtype (tiny models)")
    ap.add_argument("--plans", default="", help="part 2: only these plans, e.g. 'cfg 2,ring 2,dlo' (default: all)")
    ap.add_argument("--models", default="flux,wan,sdxl", help="part 3's models")
    ap.add_argument("--steps", type=int, default=4, help="part 3: denoising steps of a request-mode request")
    ap.add_argument("--runs", type=int, help="part 3: timed request-mode rounds after the warm-up (2; dry run 1)")
    ap.add_argument("--ticks", type=int, help="part 3: timed step-mode ticks per batch and offload arm (2; dry run 1)")
    ap.add_argument("--flux-disk", action="store_true", help="part 3: also FLUX on the disk tier (writes 24 GB)")
    ap.add_argument("--run-part", type=int, help=argparse.SUPPRESS)      # the child process of one part
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.part_list = sorted({int(p) for p in args.parts.split(",") if p.strip()})
    except ValueError:
        ap.error(f"--parts={args.parts!r}: expected part numbers from 1 to 3, e.g. 1,3")
    if not set(args.part_list) <= set(PARTS):
        ap.error(f"--parts={args.parts!r}: expected part numbers from 1 to 3, e.g. 1,3")
    args.models = [m for m in args.models.split(",") if m]
    if unknown := [m for m in args.models if m not in MODELS]:
        ap.error(f"--models={args.models!r}: {unknown} unknown; expected some of {', '.join(MODELS)}")
    args.families = [k for k in args.families.split(",") if k]
    if unknown := [k for k in args.families if k not in tiny_kinds()]:
        ap.error(f"--families={args.families!r}: {unknown} are not served kinds ({', '.join(tiny_kinds())})")
    args.plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    if unknown := [p for p in args.plans if p not in {**PLANS_2, **PLANS_4, "dlo": None}]:
        ap.error(f"--plans={args.plans!r}: {unknown} unknown; expected some of "
                 f"{', '.join({**PLANS_2, **PLANS_4})}, dlo")
    args.runs = args.runs or (1 if args.cpu_dry_run else 2)
    args.ticks = args.ticks or (1 if args.cpu_dry_run else 2)
    if args.runs < 1 or args.ticks < 1 or args.steps < 1:
        ap.error(f"--runs={args.runs}, --ticks={args.ticks}, --steps={args.steps}: each must be at least 1")
    args.dtype_list = tuple(d for d in args.dtypes.split(",") if d)
    if not args.dtype_list or (unknown := [d for d in args.dtype_list if d not in DTYPES]):
        ap.error(f"--dtypes={args.dtypes!r}: expected some of {', '.join(DTYPES)}")
    return args


def cuda_absent() -> str | None:
    """Why there is nothing to check here (None when a CUDA device is visible)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA device is visible (torch {torch.__version__}, {build})"
    return None


# -- the child: one part ------------------------------------------------------------------------------------------
def run_part(args: argparse.Namespace) -> int:
    import torch

    from gpucheck.budget import Clock
    from gpucheck.report import RowsFile
    from gpucheck.target import Target

    if args.cpu_dry_run:
        torch.set_num_threads(1)
    target = Target.dry_run() if args.cpu_dry_run else Target.cuda(args.dtype_list)
    clock, emit = Clock(args.budget, reserve_s=5.0), RowsFile(args.rows, args.run_part)
    with tempfile.TemporaryDirectory(prefix=f"part{args.run_part}-", dir=args.work) as root:
        if args.run_part == 1:
            from gpucheck import families, forkstart, residency

            rest = AFTER_FAMILIES_S[1 if target.dry else 0] * args.budget_scale
            families.run(target, Clock(min(clock.left(), args.budget - rest)), emit, root, args.families)
            residency.run(target, clock, emit, root)
            forkstart.run(target, clock, emit, root)
        elif args.run_part == 2:
            from gpucheck import parallel

            parallel.run(target, clock, emit, root, target.dtype(args.parallel_dtype), args.plans)
        else:
            from gpucheck import throughput

            args.arm_s, args.model_s = (2.0, 5.0) if target.dry else (25.0, 45.0)
            args.compile_s = 60.0 if target.dry else 90.0       # a cold and a warm regional compile, and the ticks
            throughput.run(target, clock, emit, root, args)
    return 0


# -- the parent: every part, the table, the report -----------------------------------------------------------------
def hygiene_rows(part: int, outcome, budget: float, grace: float) -> list[Row]:
    """Part 4's rows for one part: its end, and what it left (swept here; a clean part leaves nothing)."""
    ended = {"done": ("ok", f"done in {outcome.wall_s:.0f} s of {budget:.0f} s"),
             "over budget": ("budget", f"killed after {outcome.wall_s:.0f} s (budget {budget:.0f} s + {grace:g})"),
             "crashed": ("error", f"exit code {outcome.returncode} after {outcome.wall_s:.0f} s")}[outcome.status]
    last = ([line for line in outcome.output_tail.splitlines() if line.strip() and "%|" not in line] or [""])[-1][:200]
    rows = [Row(4, f"part {part} ran and ended", ended[0], ended[1], "" if outcome.status == "done" else last,
                {"wall_s": outcome.wall_s, "returncode": outcome.returncode})]
    left = outcome.processes_left or outcome.segments_left
    rows.append(Row(4, f"part {part} left no process or /dev/shm segment", "FAIL" if left else "ok",
                    f"{len(outcome.processes_left)} processes, {len(outcome.segments_left)} segments",
                    f"swept: pids {outcome.processes_left}, segments {outcome.segments_left}" if left else
                    f"{outcome.seen_processes} child processes seen, all gone",
                    {"processes_left": outcome.processes_left, "segments_left": outcome.segments_left}))
    return rows


def final_rows(env: dict, one_gpu: dict) -> list[Row]:
    """Part 4's rows about the whole run: every served family covered; one GPU, offline."""
    missing, kinds = uncovered(), tiny_kinds()
    devices = env.get("visible_devices", 0)
    return [Row(4, "every served family has a bare call", "error" if missing else "ok",
                f"{len(kinds) - len(missing)} of {len(kinds)} tiny kinds",
                f"missing: {missing}" if missing else "(gpucheck/families.py CALLS)", {"missing": missing}),
            Row(4, "one GPU, offline", "ok", f"1 of {devices} visible GPUs" if devices else "cpu dry run",
                "every part ran with " + ", ".join(f"{k}={v}" for k, v in {**one_gpu, **OFFLINE}.items()),
                {"visible_devices": devices, **one_gpu, **OFFLINE})]


def write_report(args, env: dict, header: str, rows: list[Row], parts: dict, wall: float) -> str:
    """The JSON report and the table beside it, rewritten after every part (a run cut short keeps what it did)."""
    failed = [r for r in rows if r.status in FAILING]
    text = f"{table(rows)}\n\n{anchors_section(rows)}".rstrip()
    report = {"mode": "cpu dry run" if args.cpu_dry_run else "gpu", "environment": env, "wall_s": wall,
              "parts": parts, "rows": [r.__dict__ for r in rows], "ok": not failed,
              "complete": set(parts) == set(args.part_list) and not any(r.status == "budget" for r in rows),
              "args": {k: v for k, v in vars(args).items() if k not in ("run_part", "rows", "work", "budget")}}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    path.with_suffix(".txt").write_text(f"{header}\n{text}\n")
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.run_part:
        return run_part(args)
    if not args.cpu_dry_run and (reason := cuda_absent()):
        print(f"SKIP: the GPU check needs one CUDA device: {reason}; nothing was run. "
              "`--cpu-dry-run` runs every part on CPU at toy sizes.")
        return 0
    from gpucheck.supervise import run_part as supervise

    started, work = time.monotonic(), Path(tempfile.mkdtemp(prefix="ds-gpu-check-"))
    env = environment(cuda=not args.cpu_dry_run)
    mode = "cpu dry run" if args.cpu_dry_run else f"{env['gpu']}, driver {env['driver']}, CUDA {env['cuda']}"
    header = f"# GPU check — {mode}; torch {env['torch']}; parts {args.part_list} (+ 4)"
    print(f"{header}; report {args.json}", flush=True)
    one_gpu = {} if args.cpu_dry_run else {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")
                                            .split(",")[0]}     # the parts see one device, whatever is installed
    child_env = {**os.environ, **OFFLINE, **one_gpu, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}   # plain logs
    rows: list[Row] = []
    parts: dict[int, dict] = {}
    try:
        for part in args.part_list:
            budget = BUDGETS[part][1 if args.cpu_dry_run else 0] * args.budget_scale
            rows_file = work / f"part{part}.jsonl"
            cmd = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]),
                   "--run-part", str(part), "--rows", str(rows_file), "--work", str(work), "--budget", str(budget)]
            outcome = supervise(cmd, budget, args.grace_s, work / f"part{part}.log", env=child_env)
            part_rows = read_rows(rows_file) + hygiene_rows(part, outcome, budget, args.grace_s)
            bad = [r for r in part_rows if r.status in FAILING]
            print(f"part {part}: {outcome.status} in {outcome.wall_s:.0f} s (budget {budget:.0f} s), "
                  f"{len(part_rows)} rows, {len(bad)} failed", *(f"  {format_row(r)}" for r in bad), sep="\n",
                  flush=True)
            rows += part_rows
            parts[part] = {"status": outcome.status, "wall_s": outcome.wall_s, "budget_s": budget,
                           "processes_left": outcome.processes_left, "segments_left": outcome.segments_left}
            write_report(args, env, header, rows, parts, time.monotonic() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows += final_rows(env, one_gpu)
    wall = time.monotonic() - started
    text = write_report(args, env, header, rows, parts, wall)
    failed = [r for r in rows if r.status in FAILING]
    not_run = [r for r in rows if r.status == "budget"]
    print(f"\n{text}\n\n{len(rows)} rows, {len(failed)} failed, {len(not_run)} not run for lack of time; "
          f"{wall:.0f} s; report: {args.json} (the table: {Path(args.json).with_suffix('.txt')})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
