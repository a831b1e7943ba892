"""A profile of every rank at once (``profiler:`` in the config; the ranks' half is ``worker.profiler``).

``start`` begins ``torch.profiler`` on every rank (a second start while one records: StageBusyError, 409); ``stop``
writes each rank's Chrome trace under ``profiler.dir`` and answers the files. A profile left running stops by itself
after ``max_seconds`` (the next ``stop`` answers its files).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from stage_runtime.config import ProfilerConfig
from stage_runtime.errors import RpcError, StageBusyError

log = logging.getLogger(__name__)


class ProfilerControl:
    def __init__(self, engine, config: ProfilerConfig):
        self.engine = engine
        self.config = config
        self.profile_id: str | None = None
        self.started_at: float | None = None
        self.expired: dict | None = None       # a profile stopped at max_seconds, not yet answered to a stop
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def start(self) -> dict:
        if not self.config.enabled:
            raise RpcError("the profiler is off on this stage (serve --profiler-dir DIR; the CRD's spec.profiling)")
        with self._lock:
            if self.profile_id is not None:
                raise StageBusyError(f"profile {self.profile_id!r} is recording (since "
                                     f"{time.monotonic() - self.started_at:.0f} s); POST /stop_profile first")
            profile_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
            replies = self.engine.rank_rpc("start_profile", (profile_id, self.config.dir, self.config.record_shapes,
                                                             self.config.profile_memory))
            failed = [r for r in replies if "error" in r]
            if failed:
                self.engine.rank_rpc("stop_profile")
                raise RpcError(f"start_profile: rank {failed[0]['rank']}: {failed[0]['error']}")
            self.profile_id, self.started_at, self.expired = profile_id, time.monotonic(), None
            self._timer = threading.Timer(self.config.max_seconds, self._expire, args=(profile_id,))
            self._timer.daemon = True
            self._timer.start()
        return {"profile_id": profile_id, "dir": self.config.dir, "max_seconds": self.config.max_seconds,
                "ranks": len(replies)}

    def stop(self) -> dict:
        with self._lock:
            if self.profile_id is None:
                expired, self.expired = self.expired, None
                if expired is not None:
                    return expired
                raise StageBusyError("no profile is recording (POST /start_profile first)")
            return self._stop_locked("request")

    def _stop_locked(self, why: str) -> dict:
        if self._timer is not None:
            self._timer.cancel()
        replies = self.engine.rank_rpc("stop_profile")
        answer = {"profile_id": self.profile_id, "stopped": why,
                     "seconds": round(time.monotonic() - self.started_at, 3),
                     "files": [{"rank": r["rank"], "path": r["path"], "bytes": r["bytes"]} for r in replies
                               if "path" in r]}
        self.profile_id = self.started_at = None
        return answer

    def _expire(self, profile_id: str) -> None:
        with self._lock:
            if self.profile_id != profile_id:
                return
            try:
                self.expired = self._stop_locked("max_seconds")
                log.info("profile %s stopped after max_seconds=%s", profile_id, self.config.max_seconds)
            except Exception:
                log.exception("profile %s could not be stopped at max_seconds", profile_id)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
