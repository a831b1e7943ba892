"""How a stage process ends: exit codes and the one-line termination message (docs/stage-process.md).

    0  clean shutdown (SIGTERM / shutdown message, drained)
    1  anything unexpected
    2  configuration or topology error — permanent, the operator does not restart
    3  engine dead (a worker died, a collective failed) — restartable

Before a non-zero exit, one line ``Reason: message`` goes to the termination log (``--termination-log``,
default ``/dev/termination-log`` when it exists), which Kubernetes shows as the container's
termination message and the operator copies into ``status.replicaStatuses[].lastFailure``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from stage_runtime.errors import ConfigError, EngineDeadError, ModelLoadError, StartupTimeoutError

log = logging.getLogger(__name__)

EXIT_OK, EXIT_UNEXPECTED, EXIT_CONFIG, EXIT_DEAD = 0, 1, 2, 3
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
MAX_MESSAGE_BYTES = 4096          # what the kubelet keeps of a termination message
WORKER_DIED = "WorkerDied"
STARTUP_TIMEOUT = "StartupTimeout"


def exit_code_for(exc: BaseException) -> int:
    if isinstance(exc, (ConfigError, ModelLoadError)):
        return EXIT_CONFIG
    if isinstance(exc, EngineDeadError):
        return EXIT_DEAD
    return EXIT_UNEXPECTED


def reason_for(exc: BaseException) -> str:
    if isinstance(exc, StartupTimeoutError):
        return STARTUP_TIMEOUT
    return WORKER_DIED if isinstance(exc, EngineDeadError) else type(exc).__name__


def termination_log_path(configured: str | None) -> str | None:
    if configured:
        return configured
    return DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None


def format_message(reason: str, message: str) -> str:
    line = f"{reason}: {' '.join(str(message).split())}"
    return line.encode()[:MAX_MESSAGE_BYTES].decode(errors="ignore")


def write_termination_log(path: str | None, reason: str, message: str) -> str:
    """Write ``Reason: message`` (one line) to ``path``; log it in any case. Returns the line."""
    line = format_message(reason, message)
    log.error("terminating: %s", line)
    if path is None:
        return line
    try:
        Path(path).write_text(line + "\n", encoding="utf-8")
    except OSError as exc:
        log.error("cannot write the termination log %s: %s", path, exc)
    return line
