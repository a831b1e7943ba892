"""LoraTable: the stage's LoRA adapters by name — what requests may name, pinning, ``max_loras``, who uses what.

The engine owns it; the ranks hold the weights (models.lora.manager) and are told through the declared
control RPCs ``load_lora`` / ``unload_lora`` / ``list_loras``, which ``DiffusionEngine.collective_rpc``
routes here (so HTTP ``/v1/loras`` and a ZMQ ``collective_rpc`` take the same path and rules). The table
knows nothing of the engine: it gets the engine's lock, its way to the ranks and a view of the requests in
flight (the ports), so it can be built and tested on its own.

- admission (under the engine lock): every name a request gives must be loaded, else 400 before it is
  queued; the request records each adapter's digest (``DiffusionRequest.lora_key``) and touches its LRU;
- ``load``: refused files name the adapter and key (LoraLoadError, 400); a taken name, or ``max_loras``
  reached with every resident adapter pinned or in use, is a LoraConflictError (409); otherwise the least
  recently used unpinned adapter no in-flight request names is evicted;
- ``unload``: an adapter that a waiting, running or preempted request names answers 409.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from stage_runtime.config import StageConfig
from stage_runtime.errors import InvalidRequestError, LoraConflictError, LoraLoadError, LoraNotFoundError, RpcError
from stage_runtime.model_info import ModelInfo
from stage_runtime.request import LORA_NAME_PATTERN, DiffusionRequest

LORA_RPCS = ("load_lora", "unload_lora", "list_loras")
# (method, args=(), kwargs=None, timeout=None, unique_reply_rank=None) → the ranks' replies, around the table
RankRpc = Callable[..., Any]


@dataclass
class LoraEntry:
    name: str
    path: str
    digest: str
    pinned: bool
    summary: dict
    last_used: int = 0


class LoraTable:
    def __init__(self, lock: threading.Condition, rank_rpc: RankRpc, model_info: ModelInfo, config: StageConfig,
                 live_requests: Callable[[], Iterable[DiffusionRequest]]):
        """``lock``: the engine's (admission holds it); ``rank_rpc``: a control RPC on every rank, ordered with
        the engine's waves; ``live_requests``: the requests in flight (waiting, running, preempted), read under
        ``lock``."""
        self._lock = lock
        self._rank_rpc = rank_rpc
        self.model_info = model_info
        self._live_requests = live_requests
        self.max_loras = config.max_loras
        self.entries: dict[str, LoraEntry] = {}
        self._clock = itertools.count(1)
        self._mutate = threading.Lock()             # one load / unload at a time
        self.requests_by_adapter: Counter[str] = Counter()
        self.counters = {"loads": 0, "unloads": 0, "evictions": 0, "refused": 0}
        if model_info.lora_components:       # the startup adapters (``loras:``, ``--lora``) the ranks loaded
            pinned = {spec.name: spec.pinned for spec in config.loras}
            for s in rank_rpc("list_loras", unique_reply_rank=0):
                self.entries[s["name"]] = LoraEntry(s["name"], s["path"], s["digest"], pinned.get(s["name"], True),
                                                    s, next(self._clock))
                self.counters["loads"] += 1

    # -- admission -------------------------------------------------------------------------------------------
    def resolve(self, request: DiffusionRequest) -> DiffusionRequest:
        """Every named adapter is loaded (else 400 naming ``loras.<i>.name``); the request records each file's
        digest (``DiffusionRequest.lora_key``, what the result and prompt caches key on)."""
        refs = request.sampling.loras
        if not refs:
            return request
        info = self.model_info
        if not info.lora_components:
            raise InvalidRequestError("loras", [r.name for r in refs], f"{info.pipeline_class} serves no LoRA adapters")
        with self._lock:
            for i, ref in enumerate(refs):
                if ref.name not in self.entries:
                    raise InvalidRequestError(f"loras.{i}.name", ref.name, "no LoRA adapter of that name is loaded "
                                              f"(loaded: {', '.join(self.entries) or 'none'})")
            return replace(request, lora_digests=tuple(self.entries[r.name].digest for r in refs))

    def admit(self, request: DiffusionRequest) -> None:
        """Under the engine lock, as the request is queued: its adapters are still the files it resolved to."""
        for i, (ref, digest) in enumerate(zip(request.sampling.loras, request.lora_digests, strict=True)):
            entry = self.entries.get(ref.name)
            if entry is None or entry.digest != digest:
                raise InvalidRequestError(f"loras.{i}.name", ref.name, "was unloaded or replaced while the request "
                                          "was being admitted")
        for ref in request.sampling.loras:
            self.entries[ref.name].last_used = next(self._clock)
            self.requests_by_adapter[ref.name] += 1

    def users(self, name: str) -> list[str]:
        """Ids of in-flight requests (waiting, running, preempted) that name adapter ``name``."""
        return [request.request_id for request in self._live_requests()
                if any(ref.name == name for ref in request.sampling.loras)]

    # -- management (any thread) -------------------------------------------------------------------------
    def control(self, method: str, args: tuple, kwargs: dict) -> Any:
        """One of LORA_RPCS (the engine checked that it is open)."""
        return {"load_lora": self.load, "unload_lora": self.unload, "list_loras": self.list}[method](*args, **kwargs)

    def list(self) -> list[dict]:
        with self._lock:
            return [self._view(e) for e in self.entries.values()]

    def load(self, name: str, path: str, pinned: bool = False) -> dict:
        if not isinstance(name, str) or not re.match(LORA_NAME_PATTERN, name):
            raise InvalidRequestError("name", name, f"must match {LORA_NAME_PATTERN}")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("path", path, "must be a non-empty path inside the stage")
        info = self.model_info
        if not info.lora_components:
            raise LoraLoadError(f"LoRA adapter {name!r}: {info.pipeline_class} serves no LoRA adapters")
        with self._mutate:
            with self._lock:
                if name in self.entries:
                    raise LoraConflictError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
                victim = self._victim_locked() if len(self.entries) >= self.max_loras else None
                if len(self.entries) >= self.max_loras and victim is None:
                    raise LoraConflictError(f"max_loras={self.max_loras} adapters are resident and each is pinned "
                                            f"or in use ({', '.join(self.entries)}); unload one first")
                if victim is not None:
                    evicted = self.entries.pop(victim)          # no new request can name it from here on
            try:
                summary = self._load_on_ranks(name, path)
            except BaseException:
                if victim is not None:
                    with self._lock:
                        self.entries[victim] = evicted
                raise
            if victim is not None:
                self._rank("unload_lora", victim)
                self.counters["evictions"] += 1
            entry = LoraEntry(name, path, summary["digest"], bool(pinned), summary, next(self._clock))
            with self._lock:
                self.entries[name] = entry
                self.counters["loads"] += 1
                return {**self._view(entry), "evicted": victim}

    def unload(self, name: str) -> dict:
        with self._mutate:
            with self._lock:
                if name not in self.entries:
                    raise LoraNotFoundError(f"no LoRA adapter named {name!r} is loaded "
                                            f"(loaded: {', '.join(self.entries) or 'none'})")
                users = self.users(name)
                if users:
                    raise LoraConflictError(f"LoRA adapter {name!r} is in use by {len(users)} in-flight request(s) "
                                            f"({', '.join(users[:5])}); unload it once they finish")
                del self.entries[name]
            self._rank("unload_lora", name)
            self.counters["unloads"] += 1
            return {"name": name, "unloaded": True}

    def metrics(self) -> dict:
        """Counts for ``/metrics``, and what the endpoint picker's LoRA gauge shows: the resident adapters'
        ``names``, ``max_loras``, and ``serves_loras`` (whether the model takes adapters at all)."""
        with self._lock:
            return {"resident": len(self.entries), "requests_by_adapter": dict(self.requests_by_adapter),
                    "operations": dict(self.counters), "names": sorted(self.entries), "max_loras": self.max_loras,
                    "serves_loras": bool(self.model_info.lora_components)}

    # -- internals ---------------------------------------------------------------------------------------
    def _victim_locked(self) -> str | None:
        candidates = [e for e in self.entries.values() if not e.pinned and not self.users(e.name)]
        return min(candidates, key=lambda e: e.last_used).name if candidates else None

    def _load_on_ranks(self, name: str, path: str) -> dict:
        replies = self._rank("load_lora", name, path)
        refused = next((r for r in replies if "error" in r), None)
        if refused is not None:
            self._rank("unload_lora", name)              # ranks that did load it drop it again
            self.counters["refused"] += 1
            raise LoraLoadError(refused["error"])
        return replies[0]

    def _rank(self, method: str, *args: Any) -> list:
        try:
            return self._rank_rpc(method, args)
        except RpcError as exc:
            raise RpcError(f"{method}({', '.join(map(repr, args))}) failed on the workers: {exc}") from exc

    def _view(self, e: LoraEntry) -> dict:
        return {"name": e.name, "path": e.path, "digest": e.digest, "pinned": e.pinned, "rank": e.summary["rank"],
                "modules": e.summary["modules"], "in_use": len(self.users(e.name)),
                "requests_total": self.requests_by_adapter[e.name]}
