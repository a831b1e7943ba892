"""One row of the GPU check's table, the rows file a part appends to, the table, and the environment.

A part writes each row to its rows file the moment it has it (one JSON object a line, flushed), so what a part
finished before it ran out of time or was killed is still reported. Statuses:

    ok       a check that passed          FAIL     a check that failed (the script exits 1)
    info     a measurement (no verdict)   skip     not run, with the reason
    budget   not run: the part's time budget was spent      error    the check itself broke (exits 1)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATUSES = ("ok", "FAIL", "info", "skip", "budget", "error")
FAILING = ("FAIL", "error")


@dataclass(frozen=True)
class Row:
    part: int
    check: str                       # what was checked or measured, e.g. "sdxl bfloat16 request mode"
    status: str                      # one of STATUSES
    figure: str = ""                 # the number that matters, e.g. "max|diff| 0 (<= 1)"
    detail: str = ""                 # anything a reader needs to judge it (an anchor, an error, a reason)
    data: dict = field(default_factory=dict)     # the raw numbers, for the JSON report

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: expected one of {', '.join(STATUSES)}")


class RowsFile:
    """Appends rows to ``path`` as JSON lines (the part's side); :func:`read_rows` reads them back."""

    def __init__(self, path: str | Path, part: int):
        self.path, self.part = Path(path), part
        self.started = time.monotonic()

    def __call__(self, check: str, status: str, figure: str = "", detail: str = "", **data) -> Row:
        """Write a row; its data get ``at_s``, the seconds since the part began (where its time went)."""
        row = Row(self.part, check, status, figure, detail, {**data, "at_s": round(time.monotonic() - self.started, 1)})
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(asdict(row), default=str) + "\n")
            out.flush()
            os.fsync(out.fileno())
        print(format_row(row), flush=True)
        return row


def read_rows(path: str | Path) -> list[Row]:
    """The rows a part wrote; a line cut short by a kill is dropped."""
    rows = []
    if Path(path).is_file():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                rows.append(Row(**json.loads(line)))
            except (ValueError, TypeError):
                continue
    return rows


def format_row(row: Row, detail_chars: int = 140) -> str:
    detail = row.detail if len(row.detail) <= detail_chars else row.detail[:detail_chars - 1] + "…"
    return f"{row.part:>4}  {row.check:<44.44} {row.status:<6} {row.figure:<42} {detail}".rstrip()


def table(rows: list[Row]) -> str:
    head = f"{'part':>4}  {'check':<44} {'result':<6} {'figure':<42} detail"
    return "\n".join([head, "-" * len(head), *(format_row(r) for r in rows)])


def anchors_section(rows: list[Row]) -> str:
    """The published anchors of every topic the rows name (``[topic]``), each once."""
    from gpucheck.anchors import anchors

    topics = list(dict.fromkeys(t for r in rows if (t := r.data.get("anchor"))))
    lines = [f"  [{topic}] {a.line()}" for topic in topics for a in anchors(topic)]
    return "published anchors (context, not targets: random weights, few steps, eager unless compiled):\n" + \
        "\n".join(lines) if lines else ""


def environment(cuda: bool) -> dict:
    """What the check ran on: the GPU, its driver, torch and CUDA versions; or "cpu dry run"."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "cpu_count": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    if not cuda:
        return {**env, "gpu": "cpu dry run", "driver": "cpu dry run", "cuda": "cpu dry run"}
    props = torch.cuda.get_device_properties(0)
    env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
               compute_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version(), visible_devices=torch.cuda.device_count(),
               nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None,
               driver=driver_version())
    return env


def driver_version() -> str:
    """The NVIDIA driver, from ``nvidia-smi`` (else the CUDA version the driver supports, from torch)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)
        return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        import torch

        get = getattr(torch._C, "_cuda_getDriverVersion", None)   # CUDA builds: e.g. 12080 → CUDA 12.8
        supports = "" if get is None else f"; it supports CUDA {get() // 1000}.{get() % 1000 // 10}"
        return f"unknown (nvidia-smi: {type(exc).__name__}{supports})"
