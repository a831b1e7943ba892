"""A file written all or nothing: a temp file beside it, synced, then renamed over it, so a reader (another
replica on a shared store, a resuming rank) sees the old content or the new one, never part of it. The job
store's records, outputs and leases and the step checkpoints are written so."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: str | Path, data: bytes) -> None:
    """``data`` at ``path``, all or nothing; the temp file is gone whatever happens."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(temp, "xb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
