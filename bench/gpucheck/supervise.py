"""Each part of the GPU check in a child process of its own: a time budget, and nothing left behind.

The part runs as ``gpu_check.py --run-part N`` in a new session. While it runs, every descendant it starts (the
fork server, rank processes) is recorded with its start time, and every ``/dev/shm`` segment they map or hold
open. The part watches its own deadline and stops between checks; if it is still running ``grace_s`` after its
budget (a hung collective, a kernel that never returns), its session is killed. Afterwards any recorded process
still alive is killed and any new segment that a recorded process used, or whose name carries one of their pids
(the executor names them ``ds-<pid>-…``), is unlinked; both are reported, so a clean part reports nothing.

Other processes share this machine and its ``/dev/shm``: a segment that merely appeared meanwhile is not ours.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from stage_runtime.process_tree import SHM, alive, descendants, segments_of, shm_segments, shm_used_by

POLL_S = 0.25


@dataclass
class Outcome:
    status: str                         # "done", "over budget" (killed) or "crashed" (non-zero exit)
    returncode: int | None
    wall_s: float
    processes_left: list[int] = field(default_factory=list)     # killed after the part ended
    segments_left: list[str] = field(default_factory=list)      # unlinked after the part ended
    seen_processes: int = 0
    output_tail: str = ""


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def run_part(cmd: list[str], budget_s: float, grace_s: float, log_path: Path, env: dict | None = None) -> Outcome:
    """Run ``cmd`` (a part) to its end or until ``budget_s + grace_s``; then sweep what it left."""
    before = shm_segments()
    start = time.monotonic()
    with log_path.open("wb") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    seen: dict[int, int] = {}
    used: set[str] = set()
    status = "done"
    while child.poll() is None:
        seen.update(descendants(child.pid))
        used |= shm_used_by([child.pid, *seen])
        if time.monotonic() - start > budget_s + grace_s:
            status = "over budget"
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            kill(alive(seen))
            break
        time.sleep(POLL_S)
    returncode = child.wait()
    wall = time.monotonic() - start
    if status == "done" and returncode != 0:
        status = "crashed"
    deadline = time.monotonic() + 10.0           # a fork server leaves when its parent has gone: give it a moment
    while alive(seen) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    left = alive(seen)
    kill(left)
    leaked = sorted(segments_of(shm_segments() - before, used, [child.pid, *seen]))
    for name in leaked:
        try:
            (SHM / name).unlink()
        except FileNotFoundError:
            continue
    tail = log_path.read_text(errors="replace")[-4000:] if log_path.is_file() else ""
    return Outcome(status, returncode, wall, left, leaked, len(seen), tail)
