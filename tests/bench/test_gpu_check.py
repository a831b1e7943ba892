"""bench/gpu_check.py without a GPU: SKIP with the reason and exit 0; ``--cpu-dry-run`` runs every part (CPU,
float32, toy sizes, gloo) to one table and a JSON report and leaves no process or /dev/shm segment behind; a part
that overruns its budget is killed and reported, not waited for.

The dry run here is reduced to keep the suite short (two families, one part-3 model, two parallel plans: every
part and every kind of check still runs, the ring's host staging and a world of 4 among them);
``bench/gpu_check.py --cpu-dry-run`` alone runs all of them. Its budgets are tripled here so that a busy machine
does not turn checks into "not run" rows.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.waiting import wait_until

from stage_runtime.process_tree import alive, descendants, segments_of, shm_segments, shm_used_by

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
FAMILIES = ("sd", "wan")
PLANS = ("ring 2", "tp 2 x cfg 2")
REDUCED = ["--families", ",".join(FAMILIES), "--models", "sdxl", "--plans", ",".join((*PLANS, "dlo")), "--budget-scale", "3"]


class Tracked:
    """The script as a child process, with every descendant it starts and every /dev/shm segment they use."""

    def __init__(self, args: list[str], cwd: Path):
        self.before = shm_segments()
        self.log = cwd / "gpu_check.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=cwd, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.seen: dict[int, int] = {}
        self.used: set[str] = set()

    def track(self) -> bool:
        """Record what runs now; True once the script has exited."""
        if self.proc.poll() is None:
            self.seen.update(descendants(self.proc.pid))
            self.used |= shm_used_by([self.proc.pid, *self.seen])
        return self.proc.poll() is not None

    def wait(self, timeout: float) -> int:
        try:
            wait_until(self.track, timeout=timeout, what="the GPU check to exit", poll=0.1)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.wait()

    def alive(self) -> list[int]:
        return alive(self.seen)

    def segments_left(self) -> set[str]:
        return segments_of(shm_segments() - self.before, self.used, [self.proc.pid, *self.seen])

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The reduced dry run, once: (the tracked process, its exit code, the JSON report)."""
    work = tmp_path_factory.mktemp("gpu-check")
    run = Tracked(["--cpu-dry-run", "--json", str(work / "report.json"), *REDUCED], work)
    code = run.wait(timeout=280)
    report = json.loads((work / "report.json").read_text()) if (work / "report.json").is_file() else None
    return run, code, report


def rows(report: dict, part: int) -> list[dict]:
    return [r for r in report["rows"] if r["part"] == part]


def test_without_cuda_it_says_skip_with_the_reason_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("SKIP: the GPU check needs one CUDA device: no CUDA device is visible (torch ")
    assert "a CPU-only build" in done.stdout and "--cpu-dry-run" in done.stdout
    assert not (tmp_path / ".gpu-check").exists()                  # nothing ran, no report


def test_bad_options_are_refused_naming_the_option_and_value(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run", "--plans", "cfg 3"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--plans=['cfg 3']: ['cfg 3'] unknown" in done.stderr


def test_the_dry_run_prints_one_table_and_writes_a_report_of_every_part(dry_run):
    run, code, report = dry_run
    assert code == 0, run.output[-3000:]
    assert report["mode"] == "cpu dry run" and report["ok"] and report["complete"]
    env = report["environment"]
    assert env["gpu"] == env["driver"] == env["cuda"] == "cpu dry run" and env["torch"].startswith("2.")
    assert {r["part"] for r in report["rows"]} == {1, 2, 3, 4}
    assert [r for r in report["rows"] if r["status"] not in ("ok", "info", "skip")] == []
    assert set(report["parts"]) == {"1", "2", "3"} and all(p["status"] == "done" for p in report["parts"].values())
    table = run.output[run.output.index("part  check"):]
    assert all(f"{r['part']:>4}  {r['check'][:44]}" in table for r in report["rows"])
    saved = (Path(report["args"]["json"]).with_suffix(".txt")).read_text()
    assert "part  check" in saved and "published anchors" in saved


def test_part_1_compares_each_family_and_checks_offload_preemption_and_the_fork_server(dry_run):
    _, _, report = dry_run
    part = rows(report, 1)
    families = {r["data"]["kind"]: r for r in part if r["check"].endswith("vs bare diffusers")}
    assert set(families) == set(FAMILIES)
    for row in families.values():
        assert row["data"]["dtype"] == "float32" and set(row["data"]["max_diff"]) == {"request", "step"}
        assert row["data"]["max_diff"]["request"] <= 1 and row["data"]["max_diff"]["step"] <= 2
        assert row["data"]["std"] > 1                                  # the images say something
    offload = [r for r in part if r["check"].startswith("offload ")]
    assert {(r["data"]["mode"], r["data"]["tier"]) for r in offload} == {
        ("model", "cpu<->cpu"), ("model", "cpu<->disk"), ("layerwise", "cpu<->cpu"), ("layerwise", "cpu<->disk")}
    assert all(r["data"]["bitwise"] and r["data"]["loads"] > 0 for r in offload)
    (preempt,) = [r for r in part if r["check"].startswith("preempt ")]
    assert preempt["data"]["bitwise"] and preempt["data"]["parked_bytes"] > 0 and preempt["data"]["on_host"]
    (rank,) = [r for r in part if r["check"].startswith("rank started by")]
    assert rank["data"]["method"] == "forkserver" and rank["data"]["device"] == "cpu"


def test_part_2_runs_each_plan_over_gloo_equal_to_one_rank(dry_run):
    _, _, report = dry_run
    part = rows(report, 2)
    assert part[0]["check"] == "backend" and part[0]["data"]["backend"] == "gloo"
    plans = [r for r in part if "plan" in r["data"]]
    assert [r["check"].split(" on ")[0] for r in plans] == list(PLANS)
    assert [r["data"]["world"] for r in plans] == [2, 4]
    assert all(r["status"] == "ok" and r["data"]["max_diff"] <= 2 for r in plans)
    (dlo,) = [r for r in part if r["check"].startswith("DLO dp 2 on 2 ranks")]
    assert dlo["status"] == "ok" and dlo["data"]["max_diff"] <= 1, dlo
    assert all(0 < held <= 0.55 * dlo["data"]["full_bytes"] for held in dlo["data"]["shard_bytes"])
    assert all(n > 0 for n in dlo["data"]["gathers"])


def test_part_3_measures_engine_vs_bare_step_batches_and_offload_tiers_next_to_anchors(dry_run):
    run, _, report = dry_run
    part = {r["check"]: r for r in rows(report, 3)}
    assert part["sdxl request mode: engine / bare"]["data"]["max_diff"] <= 1
    assert len(part["sdxl request mode: engine / bare"]["data"]["ratios"]) == report["args"]["runs"] == 1
    assert {part[f"sdxl step tick, batch {b}"]["data"]["batch"] for b in (1, 2, 4)} == {1, 2, 4}
    assert part["sdxl step-mode batch 4 vs sequential"]["data"]["gain"] > 0
    tiers = {(r["data"]["mode"], r["data"]["tier"]) for r in part.values() if r["data"].get("prepare_s") is not None}
    assert tiers == {("model", "cpu<->cpu"), ("layerwise", "cpu<->cpu"), ("layerwise", "cpu<->disk")}
    printed = [line for line in run.output.splitlines() if re.match(r"  \[[a-z ]+\] ", line)]
    assert sorted({line.split("]")[0][3:] for line in printed}) == ["batching", "offload", "overhead", "sdxl step"]
    assert len(printed) == len(set(printed))                             # each anchor once
    docs = (ROOT / "docs" / "testing.md").read_text()
    for line in printed:                                                 # and each the docs' table lists
        source = line.rsplit("; ", 1)[1].rstrip(")")
        assert f"| {source} |" in docs, f"docs/testing.md lists no anchor from {source}"


def test_the_dry_run_leaves_no_process_and_no_shm_segment(dry_run):
    run, _, report = dry_run
    assert run.seen, "the dry run started no process of its own"
    wait_until(lambda: not run.alive(), timeout=15, what="every process of the dry run gone")
    assert run.segments_left() == set()
    hygiene = [r for r in rows(report, 4) if "left no process" in r["check"]]
    assert len(hygiene) == 3 and all(r["status"] == "ok" for r in hygiene)
    covered = [r for r in rows(report, 4) if r["check"] == "every served family has a bare call"]
    assert covered[0]["status"] == "ok" and covered[0]["data"]["missing"] == []


def test_a_part_over_its_budget_is_killed_and_reported_not_waited_for(tmp_path):
    """Part 1 with a budget of a few milliseconds and half a second of grace: it cannot even import torch in
    time, so the supervisor kills its session, reports it, and nothing it started survives."""
    run = Tracked(["--cpu-dry-run", "--parts", "1", "--families", "sd", "--budget-scale", "0.0001",
                   "--grace-s", "0.5", "--json", str(tmp_path / "report.json")], tmp_path)
    assert run.wait(timeout=120) == 0, run.output[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["parts"]["1"]["status"] == "over budget" and not report["complete"]
    (ended,) = [r for r in rows(report, 4) if r["check"] == "part 1 ran and ended"]
    assert ended["status"] == "budget" and ended["figure"].startswith("killed after ")
    wait_until(lambda: not run.alive(), timeout=15, what="every process of the killed part gone")
    assert run.segments_left() == set()
