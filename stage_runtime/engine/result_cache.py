"""Exact-hit result cache: a repeat of a request identical in every field that affects pixels gets the
stored images without running anything.

Off unless ``cache.result_max_bytes`` > 0. Only requests with an explicit seed are ever stored or served
(a request without one asks for a new random image), and only non-streaming ones (a stream expects
progress). The key is a SHA-256 over the resolved request's pixel-affecting fields (prompt, negative
prompt, seed, size, steps, guidance, images per prompt, block-cache policy, edit inputs, a video's frames,
fps and second guidance scale, its reference picture, LoRA adapters and scales) and the model revision (its
folder, dtype, adapter and ``model_index.json``). An LRU bounded by the images' bytes: an entry over the
bound is never stored, older entries are evicted first.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from stage_runtime.config import StageConfig
from stage_runtime.engine.stream import RequestStream
from stage_runtime.outputs import Audio, Decoded, DiffusionOutput
from stage_runtime.request import DiffusionRequest, adapter_identity

PIXEL_FIELDS = ("negative_prompt", "true_cfg_scale", "seed", "height", "width", "num_inference_steps", "guidance_scale",
                "num_outputs", "cache", "num_frames", "fps", "guidance_scale_2")


def model_revision(config: StageConfig) -> str:
    """What identifies the served weights: folder, dtype, adapter and the folder's model_index.json."""
    m = config.model
    index = Path(m.path) / "model_index.json"
    digest = hashlib.sha256(index.read_bytes()).hexdigest() if index.is_file() else "-"
    return f"{m.path}|{m.dtype}|{m.adapter}|{digest}"


def result_key(request: DiffusionRequest, revision: str) -> str | None:
    """The request's cache key, or None when it must not be cached (no explicit seed, streaming)."""
    s = request.sampling
    if not request.seed_given or s.stream or s.preview_every is not None or s.partial_images:
        return None
    fields: dict[str, Any] = {name: getattr(s, name) for name in PIXEL_FIELDS}
    fields["cache"] = s.cache if s.cache is None or isinstance(s.cache, str) else s.cache.model_dump()
    fields.update(prompt=request.prompt, loras=adapter_identity(request), revision=revision)
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    if request.edit is not None:
        e = request.edit
        h.update(f"|{e.task}|{e.strength}|{e.image.shape}".encode())
        h.update(np.ascontiguousarray(e.image).tobytes())
        for image in e.more_images:                # Edit-Plus: every image, in order
            h.update(f"|{image.shape}".encode())
            h.update(np.ascontiguousarray(image).tobytes())
        if e.mask is not None:
            h.update(np.ascontiguousarray(e.mask).tobytes())
    if request.reference is not None:        # image-to-video (LTX-2 serves both: with and without a picture)
        h.update(f"|reference|{request.reference.shape}".encode())
        h.update(np.ascontiguousarray(request.reference).tobytes())
    if request.video_input is not None:      # video-to-video: the source video, its mask, each reference image
        for name, array in request.video_input.arrays():
            h.update(f"|{name}|{array.shape}".encode())
            h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


class ResultCache:
    """Bytes-bounded LRU of finished images by request key, filled from delivered outputs."""

    def __init__(self, max_bytes: int, revision: str = ""):
        self.max_bytes = max_bytes
        self.revision = revision
        self._entries: OrderedDict[str, Decoded] = OrderedDict()      # key → images (and a video's sound)
        self._expected: dict[str, str] = {}          # request id in flight → its key
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    @classmethod
    def from_config(cls, config: StageConfig) -> "ResultCache":
        """The stage's cache; with ``result_max_bytes`` 0 it is off: every lookup misses, nothing is kept."""
        size = config.cache.result_max_bytes
        return cls(size, model_revision(config) if size > 0 else "")

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- the engine's side ------------------------------------------------------------------------------
    def lookup(self, request: DiffusionRequest) -> tuple[str | None, RequestStream | None]:
        """(the request's key, a finished stream on a hit); a miss is stored when ``expect`` was called."""
        started = time.monotonic()
        key = result_key(request, self.revision) if self.enabled else None
        if key is None:
            return None, None
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return key, None
            self._entries.move_to_end(key)
            self.hits += 1
        stream = RequestStream(request.request_id)
        e2e_ms = (time.monotonic() - started) * 1e3
        audio = None if entry.audio is None else Audio(entry.audio.samples.copy(), entry.audio.sample_rate)
        stream.put(DiffusionOutput(request.request_id, images=entry.images.copy(), audio=audio,
                                   step_index=request.num_steps,
                                   num_steps=request.num_steps,
                                   metrics={"queue_ms": 0.0, "exec_ms": 0.0, "e2e_ms": e2e_ms, "result_cache_hit": 1}))
        return key, stream

    def expect(self, request_id: str, key: str | None) -> None:
        """The admitted request's images go under ``key`` when it completes."""
        if key is not None:
            with self._lock:
                self._expected[request_id] = key

    def on_delivered(self, output: DiffusionOutput) -> None:
        """Every final output of the engine: a completed expected request is stored; any other forgotten."""
        if not self._expected:
            return
        with self._lock:
            key = self._expected.pop(output.request_id, None)
        if key is not None and output.ok:
            self.put(key, output.images, output.audio)

    def num_expected(self) -> int:
        return len(self._expected)

    # -- the LRU ------------------------------------------------------------------------------------------
    def put(self, key: str, images: np.ndarray, audio: Audio | None = None) -> bool:
        """Store a copy (with the sound, for a family that makes it); evict least recently used entries until
        the bound holds (False: too big to keep)."""
        entry = Decoded(images.copy(), None if audio is None else Audio(audio.samples.copy(), audio.sample_rate))
        size = entry.nbytes
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            while self._entries and self.nbytes + size > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes
                self.evictions += 1
            self._entries[key] = entry
            self.nbytes += size
        return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions}
