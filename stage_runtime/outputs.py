"""Outputs as plain data: what the runner returns per request and what a request's stream delivers.

Nothing here holds a tensor or a callable: images are numpy uint8 arrays, shape (num_outputs, H, W, 3) (a video's
(num_outputs, F, H, W, 3)); a family with sound (LTX-2) adds its waveform as float32 samples (``Audio``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Audio:
    """A request's sound, as the pipeline's ``.audio``: float32 samples (num_outputs, channels, samples) in [-1, 1]
    at ``sample_rate`` Hz, one track per output video. Small beside the frames (about 0.4 MB a second of 48 kHz
    stereo), so it always travels inline with its output, never through shared memory."""

    samples: np.ndarray
    sample_rate: int

    def track(self, index: int) -> "Audio":
        """Output ``index``'s track alone: (1, channels, samples)."""
        return Audio(self.samples[index:index + 1], self.sample_rate)

    @property
    def seconds(self) -> float:
        return self.samples.shape[-1] / self.sample_rate


@dataclass
class Decoded:
    """A decode that yields more than pixels: the frames and the sound decoded with them (``StepContract.decode``)."""

    images: np.ndarray | None
    audio: Audio | None = None

    @property
    def nbytes(self) -> int:
        return (0 if self.images is None else int(self.images.nbytes)) + \
            (0 if self.audio is None else int(self.audio.samples.nbytes))

    @classmethod
    def of(cls, value: "np.ndarray | Decoded") -> "Decoded":
        """An adapter's decode as (images, audio): a bare array is pixels alone."""
        return value if isinstance(value, Decoded) else cls(value)


@dataclass
class RunnerOutput:
    """One request's result from one executed wave (request mode) or tick (step mode)."""

    request_id: str
    images: np.ndarray | None = None        # uint8 (num_outputs, H, W, 3), set when finished without error
    error: str | None = None                 # this request failed; its batch-mates are unaffected
    aborted: bool = False                    # the runner stopped computing it because it was aborted
    step_index: int | None = None            # denoising steps completed so far
    finished: bool = True
    async_output_id: str | None = None       # mp request mode: images follow as OUTPUT_READY under this id
    compute_ms: float | None = None          # request mode: wall time of the pipeline call that produced it
    cache: dict[str, int] | None = None      # block cache on: {"steps_computed", "steps_skipped"} so far
    audio: Audio | None = None               # finished with sound (LTX-2): inline, even when the images go by shm

    @classmethod
    def failed(cls, request_id: str, exc: BaseException) -> "RunnerOutput":
        """The request failed with ``exc``: its type and message, as plain text (no tensors kept)."""
        return cls(request_id, error=f"{type(exc).__name__}: {exc}")


@dataclass
class BatchRunnerOutput:
    """Results of one execute call, looked up by request id (never by position)."""

    outputs: dict[str, RunnerOutput] = field(default_factory=dict)

    @classmethod
    def of(cls, *outputs: RunnerOutput) -> "BatchRunnerOutput":
        return cls({o.request_id: o for o in outputs})

    @classmethod
    def failed(cls, request_ids: list[str], exc: BaseException) -> "BatchRunnerOutput":
        """Every request of a call that raised fails with the exception's type and message."""
        return cls.of(*(RunnerOutput.failed(rid, exc) for rid in request_ids))

    def get(self, request_id: str) -> RunnerOutput | None:
        return self.outputs.get(request_id)


# What a running request is doing, in order: its prompt (and reference image) encoded, denoising step k of N,
# the VAE decode; "mux" is the server's, after the engine: encoding the frames into an MP4.
PHASES = ("encode", "denoise", "decode", "mux")


@dataclass(frozen=True)
class ProgressEvent:
    """These requests entered a phase (encode, decode) or a denoising step (emitted during execution). Only
    ``denoise`` events take part in cancellation (the runner agrees on cancels at step boundaries)."""

    request_ids: tuple[str, ...]
    step_index: int                          # steps completed
    num_steps: int
    phase: str = "denoise"


# Runner → engine once per denoising step; returns the ids the engine wants stopped.
ProgressHook = Callable[[ProgressEvent], Iterable[str]]

# Executor → engine when request-mode images arrive after their COMPUTE_DONE:
# (async output id, uint8 images (n, H, W, 3) or None, error or None — why they are lost).
OutputHook = Callable[[str, Any, "str | None"], None]


@dataclass
class DiffusionOutput:
    """What a request's output stream yields. Exactly one item per request has ``finished=True``."""

    request_id: str
    finished: bool = True
    images: np.ndarray | None = None         # uint8 (num_outputs, H, W, 3) on success
    error: str | None = None
    error_type: str | None = None            # an errors.* error_type, e.g. "request_aborted"
    step_index: int | None = None            # progress items: steps done of num_steps
    num_steps: int | None = None
    phase: str | None = None                 # progress items: PHASES (None on the final item)
    metrics: dict[str, float] = field(default_factory=dict)   # queue_ms, exec_ms, e2e_ms (+ compute_ms)
    audio: Audio | None = None               # the final item of a family with sound (LTX-2)

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None and self.images is not None

    def summary(self) -> dict[str, Any]:
        shape = None if self.images is None else list(self.images.shape)
        return {"request_id": self.request_id, "finished": self.finished, "error": self.error,
                "error_type": self.error_type, "images": shape, "metrics": self.metrics}
