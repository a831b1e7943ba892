"""Prompt-embedding cache: an LRU of encoded prompts keyed by (text encoder, prompt call, adapters).

Installed over the pipeline's own ``encode_prompt`` (an instance attribute, so diffusers' ``__call__`` in
request mode and the families' ``prepare_encode`` in step mode both go through it) when
``cache.prompt_max_bytes`` > 0. The key is the pipeline class and its text encoders' identities, every
argument of the call (prompt, negative prompt, images per prompt, CFG flag, sequence length, LoRA scale,
device) and the LoRA adapters the runner says are active (``adapters(...)``); a call given tensors
(precomputed embeddings) or generators is never cached. Values are the returned tensors; a hit returns
clones, so no caller can change a stored entry. Bounded by the tensors' bytes; an entry over the bound
is not stored. Pipelines without ``encode_prompt`` (DiT: class labels) get no cache.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Any

import torch

ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def _plain(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool, type(None), torch.device, torch.dtype)):
        return True
    return isinstance(value, (list, tuple)) and all(_plain(v) for v in value)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


class PromptEmbeddingCache:
    def __init__(self, max_bytes: int, encoder_id: str = ""):
        self.max_bytes = max_bytes
        self.encoder_id = encoder_id
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._adapters: tuple = ()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.contextmanager
    def adapters(self, identity: tuple):
        """The LoRA adapters (name, scale) active for the encodes inside (part of every key)."""
        previous, self._adapters = self._adapters, tuple(identity)
        try:
            yield
        finally:
            self._adapters = previous

    def key(self, args: tuple, kwargs: dict) -> str | None:
        if not all(_plain(a) for a in args) or not all(_plain(v) for v in kwargs.values()):
            return None
        return repr((self.encoder_id, self._adapters, args, sorted(kwargs.items())))

    def get(self, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return _clone(entry[0])

    def put(self, key: str, value: Any) -> bool:
        size = sum(t.nbytes for t in _tensors(value))
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            while self._entries and self.nbytes + size > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.nbytes -= evicted
                self.evictions += 1
            self._entries[key] = (_clone(value), size)
            self.nbytes += size
        return True

    def wrap(self, encode):
        def cached_encode(*args, **kwargs):
            key = self.key(args, kwargs)
            if key is not None:
                hit = self.get(key)
                if hit is not None:
                    return hit
            value = encode(*args, **kwargs)
            if key is not None:
                self.put(key, value)
            return value

        cached_encode.__wrapped__ = encode
        return cached_encode

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions}


def install(pipe, max_bytes: int) -> PromptEmbeddingCache | None:
    """Put a cache over ``pipe.encode_prompt``; None when off or the pipeline encodes no prompt."""
    encode = getattr(pipe, "encode_prompt", None)
    if max_bytes <= 0 or encode is None:
        return None
    encoders = ",".join(f"{name}:{id(getattr(pipe, name))}" for name in ENCODERS if getattr(pipe, name, None))
    cache = PromptEmbeddingCache(max_bytes, f"{type(pipe).__name__}[{encoders}]")
    pipe.encode_prompt = cache.wrap(encode)
    return cache
