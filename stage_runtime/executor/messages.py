"""What crosses between the engine process and its worker ranks (pickled over ZMQ, plain data only).

    engine ──broadcast (XPUB → every rank's SUB)──▶ ExecuteModel | RpcMessage | CancelMessage | SHUTDOWN
    rank r ──its own result channel (PUSH → PULL)──▶ RpcReply | ComputeDone | OutputReady | Progress | Fatal

Reply rules (``WorkerProc``): a model call (``ExecuteModel``) runs on every rank and is answered by each
DP replica's leader (request mode: ComputeDone, then OutputReady for large images; step mode: RpcReply);
a control RPC (``RpcMessage``, a name from ``stage_runtime.control.CONTROL_RPCS``) with
``reply_rank=None`` runs on every rank and every rank answers with its own status; with ``reply_rank=r``
it runs and answers on rank r only. Arrays over ~1 MB inside a message are ``shm.ShmArray`` handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class ExecuteModel:
    """Run one scheduler output (a request-mode wave or a step-mode tick; ``sched_out.mode`` says which)."""

    rpc_id: int
    sched_out: Any                             # SchedulerOutput (plain data: requests once, then ids)
    dp_assign: dict[str, int] | None = None    # request id → DP replica that runs it (None: one replica)
    dp_pad: dict[int, str] | None = None       # DLO waves: replica → request it runs as padding, result dropped


@dataclass(frozen=True)
class RpcMessage:
    """A control RPC: ``method`` is one of ``CONTROL_RPCS``."""

    rpc_id: int
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    reply_rank: int | None = None


@dataclass(frozen=True)
class CancelMessage:
    """Stop computing these requests of the model call ``rpc_id`` (request mode, at the next step)."""

    rpc_id: int
    request_ids: tuple[str, ...]


@dataclass
class RpcReply:
    rpc_id: int
    rank: int
    ok: bool = True
    result: Any = None
    error: str | None = None             # "<ExceptionType>: message"
    traceback: str | None = None


@dataclass
class ComputeDone(RpcReply):
    """Request mode: the forward is done (the rank takes the next wave). ``result`` is a
    BatchRunnerOutput; outputs whose images exceed the shared-memory threshold carry ``async_output_id``
    instead (their images follow as OUTPUT_READY), smaller images are inline."""


@dataclass
class OutputReady:
    """The images of earlier ComputeDone outputs, by async output id (or why they could not be sent)."""

    rank: int
    images: dict[str, Any]               # async_output_id → uint8 (n, H, W, 3) ndarray or ShmArray
    error: str | None = None
    failed_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Progress:
    """A replica leader started denoising step ``step_index`` of a model call, or entered its encode or decode phase."""

    rpc_id: int
    rank: int
    request_ids: tuple[str, ...]
    step_index: int
    num_steps: int
    phase: str = "denoise"          # or "encode" / "decode": a notice, no cancel agreement (outputs.PHASES)


@dataclass(frozen=True)
class Fatal:
    """The rank cannot go on (a collective failed or timed out); it exits right after sending this."""

    rank: int
    reason: str
