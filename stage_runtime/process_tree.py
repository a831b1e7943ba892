"""What a process tree runs and holds, read from ``/proc``: the hygiene probe of the tests and the GPU check.

A process is named by its pid and its start time (a pid can be reused); a ``/dev/shm`` segment counts as a process's
when the process maps it or holds it open. Linux only. Never imports torch: the readers watch the processes that do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM = Path("/dev/shm")
_SHM_PATH = re.compile(r"/dev/shm/(\S+)")


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of a process, None when it is gone. A process that exits between the open and the
    read raises ESRCH (ProcessLookupError), not FileNotFoundError: every OSError here means gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """pid → start time of every live descendant of ``root``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append(int(entry))
            starts[int(entry)] = stat[2]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def alive(seen: dict[int, int]) -> list[int]:
    """The recorded processes (pid → start time) still running: the same process (same start time), not a zombie."""
    return sorted(pid for pid, start in seen.items()
                  if (stat := proc_stat(pid)) is not None and stat[2] == start and stat[1] != "Z")


def shm_segments() -> set[str]:
    """The names in ``/dev/shm`` now."""
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def shm_used_by(pids) -> set[str]:
    """The segments these processes map or hold open right now."""
    used = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        used.update(_SHM_PATH.findall(maps))
        used.update(link.removeprefix("/dev/shm/") for link in links if link.startswith("/dev/shm/"))
    return used


def segments_of(new: set[str], used: set[str], pids) -> set[str]:
    """Of the segments that appeared while processes were tracked (``new``), theirs: those they used, or whose name
    carries one of their pids (the multiprocess executor names its segments ``ds-<pid>-…``). Other processes share
    ``/dev/shm``: a segment that merely appeared meanwhile is not theirs."""
    ids = {str(pid) for pid in pids}
    return {name for name in new if name in used or ids & set(re.split(r"[^0-9]+", name))}
