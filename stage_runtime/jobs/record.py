"""A video job's record — the JSON the store keeps — and the OpenAI ``Video`` object it answers as.

The record holds what any replica needs to run the job again (``params``: the create request's fields as
validated, the seed fixed at create) and what a client polls: ``status``, the phase and step of the run,
``progress`` from them, the times, the error. ``owner`` and ``lease_expires_at`` say which replica runs it
(``jobs.lease`` decides; the record only shows it). ``step`` is the last denoising step the owner reported;
``checkpoint_step`` the step of the job's newest step checkpoint, ``resumed_from_step`` where the run started.
``runs`` is the job's history, one :class:`RunEntry` a run: who ran it, from which step to which, and how it ended
(a run whose owner vanished is closed by the next owner, ``lease_expired`` at the last step it reported).

A record is read leniently (unknown fields are ignored): in a rolling upgrade an older replica still reads what a
newer one wrote.

Ids are ``video_`` + 12 hex digits of the creation time in milliseconds + 20 random hex digits: they sort
in creation order, so a list pages by id and a page's ``after`` needs no record to still exist.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["queued", "in_progress", "completed", "failed"]
STATUSES: tuple[str, ...] = get_args(Status)
ACTIVE: tuple[str, ...] = ("queued", "in_progress")      # the SDK's poll() keeps polling these
JOB_ID = re.compile(r"^video_[0-9a-f]{32}$")
# progress: the denoising steps are 0–90 %, the VAE decode starts at 90, writing the MP4, thumbnail and frames
# at 95, completed is 100
DENOISE_SHARE, DECODE_AT, MUX_AT = 90, 90, 95
MAX_RUNS = 20                                            # the history keeps the newest runs
# How a run ended: the job's own end, or back in the queue (handed_off: the replica drained and gave it away at a
# checkpoint; requeued: its engine died or the drain timed out), or its owner vanished (lease_expired).
OUTCOMES = ("completed", "failed", "handed_off", "requeued", "lease_expired")


def new_job_id(now: float) -> str:
    return f"video_{int(now * 1000):012x}{secrets.token_hex(10)}"


def progress_of(phase: str | None, step: int, num_steps: int) -> int:
    """0–100 from where the run is: ``encode`` 0, after denoising step k of N ``90·k/N`` (rounded down),
    ``decode`` 90, ``mux`` (the server writes the outputs) 95."""
    if phase == "decode":
        return DECODE_AT
    if phase == "mux":
        return MUX_AT
    if phase == "denoise" and num_steps > 0:
        return min(DENOISE_SHARE, DENOISE_SHARE * step // num_steps)
    return 0


def seconds_of(num_frames: int, fps: int) -> str:
    """The clip's length as OpenAI's ``seconds`` string: F frames at ``fps`` last (F - 1) / fps seconds."""
    value = (num_frames - 1) / fps
    return str(int(value)) if value == int(value) else f"{value:.3g}"


class JobError(BaseModel):
    """OpenAI's ``VideoCreateError``: a machine-readable ``code`` (our error type) and the message."""

    model_config = ConfigDict(extra="ignore")
    code: str
    message: str
    param: str | None = None


class RunEntry(BaseModel):
    """One run of the job: its owner, when it started and from which step (the checkpoint it resumed, else 0),
    and once it ended: when, at which step (the steps whose state survives it: a hand-off's checkpoint, the last
    step reported before a lost lease) and how (``OUTCOMES``)."""

    model_config = ConfigDict(extra="ignore")
    owner: str
    started_at: float
    from_step: int = 0
    ended_at: float | None = None
    to_step: int | None = None
    outcome: str | None = None

    def closed(self, outcome: str, to_step: int, at: float) -> RunEntry:
        return self.model_copy(update={"outcome": outcome, "to_step": to_step, "ended_at": at})


class JobRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = Field(pattern=JOB_ID.pattern)
    model: str                                     # the served model's id; only its replicas run the job
    prompt: str
    params: dict[str, Any]                         # the create request's fields (seed fixed), to rebuild it
    size: str                                      # WIDTHxHEIGHT, resolved against the model
    num_frames: int
    fps: int
    num_steps: int
    reference: bool = False                        # the job's folder holds reference.png (image-to-video)
    video_input: bool = False                      # … video_input.npz (video-to-video: VideoInput.to_bytes)
    status: Status = "queued"
    phase: str | None = None                       # encode | denoise | decode | mux while in progress
    step: int = 0                                  # denoising steps done, as the owner last reported
    progress: int = Field(0, ge=0, le=100)
    created_at: float
    started_at: float | None = None                # the current run's start
    completed_at: float | None = None              # when it finished (completed or failed)
    expires_at: float | None = None                # record and files are deleted then (set when it finishes)
    error: JobError | None = None
    owner: str | None = None                       # the replica running it (host-pid), while in progress
    lease_expires_at: float | None = None          # the owner's lease as last renewed
    attempts: int = 0                              # runs started so far
    handoffs: int = 0                              # runs a draining replica handed off (not failures)
    requeued_because: str | None = None            # why the last run ended without the job's own fault
    checkpoint_step: int | None = None             # the step of the job's newest checkpoint (store: CHECKPOINT)
    resumed_from_step: int | None = None           # the current (or last) run started from a checkpoint at this step
    decode_retries: int = 0                        # decodes run again from the denoised state after a failed one
    outputs: tuple[str, ...] = ()                  # files of the completed job (the store's OUTPUTS)
    runs: tuple[RunEntry, ...] = ()                # the history, oldest first (the newest MAX_RUNS)

    @property
    def failed_attempts(self) -> int:
        """The runs that count against ``jobs.max_attempts``: every run but those handed off at a drain."""
        return self.attempts - self.handoffs

    def with_run_ended(self, outcome: str, to_step: int, at: float) -> tuple[RunEntry, ...]:
        """The history with its open run (the newest, not yet ended) closed."""
        if not self.runs or self.runs[-1].ended_at is not None:
            return self.runs
        return (*self.runs[:-1], self.runs[-1].closed(outcome, to_step, at))

    @property
    def reached_step(self) -> int:
        """The furthest step the job is known to have reached: the step its owner last reported, or its newest
        checkpoint's when that is later (a progress write may lag the checkpoint written at the same tick)."""
        return max(self.step, self.checkpoint_step or 0)

    def with_run_started(self, owner: str, from_step: int, at: float) -> tuple[RunEntry, ...]:
        """The history with a run beginning now; a run left open (its owner vanished: the lease expired) is closed
        at the furthest step it is known to have reached."""
        runs = self.with_run_ended("lease_expired", self.reached_step, at)
        return (*runs, RunEntry(owner=owner, started_at=at, from_step=from_step))[-MAX_RUNS:]

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    @property
    def seconds(self) -> str:
        return str(self.params["seconds"]) if self.params.get("seconds") is not None \
            else seconds_of(self.num_frames, self.fps)

    def video(self) -> dict[str, Any]:
        """The OpenAI ``Video`` object, with what this stage adds under ``diffstage``."""
        def stamp(value: float | None) -> int | None:
            return None if value is None else int(math.floor(value))

        return {
            "id": self.id, "object": "video", "model": self.model, "status": self.status, "progress": self.progress,
            "created_at": stamp(self.created_at), "completed_at": stamp(self.completed_at),
            "expires_at": stamp(self.expires_at), "error": None if self.error is None else self.error.model_dump(),
            "prompt": self.prompt, "seconds": self.seconds, "size": self.size, "remixed_from_video_id": None,
            "diffstage": {"phase": self.phase, "step": self.step, "num_steps": self.num_steps,
                          "num_frames": self.num_frames, "fps": self.fps, "seed": self.params.get("seed"),
                          "owner": self.owner, "attempts": self.attempts, "handoffs": self.handoffs,
                          "requeued_because": self.requeued_because, "checkpoint_step": self.checkpoint_step,
                          "resumed_from_step": self.resumed_from_step, "decode_retries": self.decode_retries,
                          "runs": [run.model_dump() for run in self.runs]},
        }
