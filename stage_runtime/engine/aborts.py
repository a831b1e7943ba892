"""Aborting requests: by id, counted (with the steps each had done), or every one in flight. An abort is queued and
applied by the busy loop at the next step boundary (a step in progress is never interrupted). A part of
:class:`~stage_runtime.engine.engine.DiffusionEngine` (its mixin)."""

from __future__ import annotations


class EngineAborts:
    def abort(self, request_ids: str | list[str]) -> list[str]:
        """Abort waiting or running requests; returns the ids that were in flight (others are unknown)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            if self._closed:
                return []
            known = [rid for rid in ids if rid in self.outputs]
            self._abort_ids.extend(known)
            self._lock.notify_all()
        return known

    def abort_counted(self, request_ids: list[str]) -> dict[str, int]:
        """Abort as :meth:`abort`, and say how many denoising steps each in-flight one had done when its abort was
        registered (after it, a running request finishes at most the step in progress)."""
        with self._lock:
            done = {s.request_id: s.step_index for s in self.scheduler.live_states(request_ids)}
            return {rid: done.get(rid, 0) for rid in self.abort(request_ids)}

    def abort_all(self) -> list[str]:
        with self._lock:
            return self.abort(self.outputs.user_request_ids())      # (the lock is re-entrant)
