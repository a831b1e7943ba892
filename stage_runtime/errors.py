"""The errors diffstage raises on purpose, as one tree and one registry.

    DiffStageError
    ├── ConfigError            bad configuration or topology        CLI exit 2, HTTP 400
    │   └── LoraLoadError          a LoRA file refused (names adapter + key)  exit 2 at startup, HTTP 400
    ├── ModelLoadError         the model folder cannot be served    CLI exit 2
    ├── RequestError           one request's fault; never the engine's
    │   ├── InvalidRequestError    bad parameters                   HTTP 400 (names the field)
    │   ├── RequestTooLargeError   an upload over the byte or pixel limit  HTTP 413 (names the part)
    │   ├── UnauthorizedError      no valid API key                 HTTP 401
    │   ├── DuplicateRequestError  request id already in flight     HTTP 409
    │   ├── QueueFullError         waiting queue at max_waiting      HTTP 429
    │   ├── RequestAbortedError    aborted by a client or a drain    HTTP 409
    │   ├── DeadlineExceededError  past its timeout_s (queued or running)  HTTP 504
    │   ├── LoraConflictError      adapter in use / name taken / max_loras full  HTTP 409
    │   ├── LoraNotFoundError      no adapter of that name (DELETE /v1/loras/{name})  HTTP 404
    │   └── RequestFailedError     the pipeline call failed          HTTP 500
    ├── EngineStartupError     warmup or startup failed             CLI exit 1
    │   └── StartupTimeoutError    not ready within the startup budget  CLI exit 1 (restartable)
    ├── ModelFetchError        fetch-model could not deliver         fetch-model exit 4 (restartable)
    │   └── ChecksumMismatchError  the archive's SHA-256 is not the one asked for
    ├── EngineClosedError      the engine is closed or closing       HTTP 503
    ├── EngineDeadError        a worker died / collective failed     HTTP 503, exit 3
    ├── StageUnavailableError  the stage is starting or draining     HTTP 503 (retry on another replica)
    ├── RpcError               a control RPC failed on the workers   ZMQ error for that rpc_id
    └── WorkerFatalError       inside a rank: it cannot go on (a collective failed or timed
                               out); never a per-request error — the rank exits, the engine dies

Per-request failures stay per-request: they end one request's stream and never the engine.

Each class says how it travels, as class attributes (docs/errors.md holds the same table; a test compares them):

    error_type   the wire type: HTTP ``error.type``, ZMQ ``error_type``, a failed output's ``error_type``
                 (None: it never reaches a client)
    http_status  the HTTP status of an answer it ends (ZMQ ``status_code`` too); None: it never answers a
                 request (500 if it ever did)
    outcome      what a request it ends counts as (``diffstage_requests_total{outcome}``, ``/v1/stats``);
                 None: it never ends a request

The lookups (:func:`registry`, :func:`by_type`, :func:`by_name`, :func:`outcome_of`, :func:`from_wire`) are the
only tables: the frontends, the engine and the executor ask them instead of keeping their own.
"""

from __future__ import annotations

from typing import ClassVar


class DiffStageError(Exception):
    """Root of every error diffstage raises on purpose."""

    error_type: ClassVar[str | None] = None
    http_status: ClassVar[int | None] = None
    outcome: ClassVar[str | None] = None
    # What the constructor takes besides a message (such a class is not rebuilt from a wire message alone).
    fields: ClassVar[tuple[str, ...]] = ()


# -- one request's fault --------------------------------------------------------------------------------------
class RequestError(DiffStageError):
    """A failure that belongs to one request."""

    error_type, http_status, outcome = "request_error", 500, "failed"


class InvalidRequestError(RequestError, ValueError):
    """Bad request parameters; ``field`` names the offending one."""

    error_type, http_status, outcome = "invalid_request_error", 400, "invalid"
    fields = ("field", "value", "reason")

    def __init__(self, field: str, value: object, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field}={value!r}: {reason}")


class RequestTooLargeError(RequestError, ValueError):
    """An upload over the configured bytes or pixels (HTTP 413); ``field`` names the part."""

    error_type, http_status, outcome = "request_too_large", 413, "invalid"
    fields = ("field", "reason")

    def __init__(self, field: str, reason: str):
        self.field = field
        super().__init__(f"{field}: {reason}")


class UnauthorizedError(RequestError):
    """A ``/v1/*`` call without a valid ``Authorization: Bearer`` key when API keys are on (HTTP 401); refused
    before any request is read, so it counts as no outcome."""

    error_type, http_status, outcome = "unauthorized", 401, None


class DuplicateRequestError(RequestError, ValueError):
    error_type, http_status, outcome = "duplicate_request_id", 409, "invalid"


class QueueFullError(RequestError):
    error_type, http_status, outcome = "queue_full", 429, "rejected"


class StageBusyError(RequestError):
    """An admin operation that needs the stage idle or alone found it otherwise: a sleep whose drain timeout passed
    with requests still in flight (the stage stays awake), a profile started while one records."""

    error_type, http_status, outcome = "stage_busy", 409, None


class RequestAbortedError(RequestError):
    error_type, http_status, outcome = "request_aborted", 409, "aborted"


class DeadlineExceededError(RequestError):
    """The request's ``timeout_s`` passed: it ended unrun (queued) or at the next step (running)."""

    error_type, http_status, outcome = "deadline_exceeded", 504, "deadline_exceeded"


class LoraConflictError(RequestError):
    """A LoRA management call that conflicts with the resident set: unloading an adapter in-flight requests
    use, loading a name that is taken, or ``max_loras`` reached with every resident adapter pinned or in use."""

    error_type, http_status, outcome = "lora_conflict", 409, None


class LoraNotFoundError(RequestError):
    """``DELETE /v1/loras/{name}`` for a name that is not loaded."""

    error_type, http_status, outcome = "not_found", 404, None


class JobNotFoundError(RequestError):
    """A ``/v1/videos/{id}`` job the store does not hold: never created, deleted, or expired."""

    error_type, http_status, outcome = "not_found", 404, None


class JobNotReadyError(RequestError):
    """``GET /v1/videos/{id}/content`` of a job that has not completed (queued, in progress or failed)."""

    error_type, http_status, outcome = "video_not_ready", 409, None


class RequestFailedError(RequestError):
    error_type, http_status, outcome = "request_failed", 500, "failed"


# -- configuration and the model ------------------------------------------------------------------------------
class ConfigError(DiffStageError, ValueError):
    """Bad configuration or parallel topology (a stage exits 2 on it); if one ever answers a request, it is a
    bad request (InvalidRequestError's wire type, which that class owns)."""

    error_type, http_status, outcome = InvalidRequestError.error_type, 400, "invalid"


class LoraLoadError(ConfigError):
    """A LoRA adapter file that cannot be applied to the served model; the message names the adapter, its
    file and the first key that does not fit (exit 2 for a startup adapter, HTTP 400 for ``POST /v1/loras``)."""


class ModelLoadError(DiffStageError):
    """The model folder is missing, unreadable, or its pipeline is not supported."""


class ModelFetchError(DiffStageError, RuntimeError):
    """``fetch-model`` could not deliver the model (network, HTTP status, disk): worth a retry."""


class ChecksumMismatchError(ModelFetchError):
    """The downloaded archive's SHA-256 differs from the one asked for (``--sha256``)."""


# -- the engine and the stage ---------------------------------------------------------------------------------
class EngineClosedError(DiffStageError, RuntimeError):
    error_type, http_status, outcome = "engine_closed", 503, "unavailable"


class EngineDeadError(DiffStageError, RuntimeError):
    """A worker died or a collective failed: the engine is latched dead (fail closed)."""

    error_type, http_status, outcome = "engine_dead", 503, "dead"


class EngineStartupError(DiffStageError, RuntimeError):
    """The engine could not start (e.g. the warmup request failed); it was closed again."""

    error_type = "engine_startup"


class StartupTimeoutError(EngineStartupError):
    """The stage was not ready within its startup budget (``--startup-timeout``); the message names the phase."""

    error_type = "startup_timeout"


class WorkerFatalError(DiffStageError, RuntimeError):
    """Raised inside a worker rank when it cannot continue (e.g. a collective failed or timed out).

    The runner never turns it into a per-request error: the rank reports it and exits, and the
    executor fails closed (every in-flight request then ends with EngineDeadError).
    """

    error_type = "worker_fatal"


class StageUnavailableError(DiffStageError, RuntimeError):
    """The stage process is starting or draining: it admits nothing now (another replica may)."""

    error_type, http_status, outcome = "stage_unavailable", 503, "unavailable"


class JobsNotConfiguredError(DiffStageError):
    """A ``/v1/videos`` job route on a stage started without ``--job-store``."""

    error_type, http_status = "jobs_not_configured", 404


class JobStoreError(DiffStageError, OSError):
    """The job store could not be read or written (a full disk, a lost volume, an object store out of reach). Its
    HTTP answer carries ``Retry-After``: nothing was stored, the same request may be sent again."""

    error_type, http_status = "job_store_unavailable", 503
    retry_after_s: ClassVar[int] = 5


class RpcError(DiffStageError, RuntimeError):
    """A control RPC (``collective_rpc``) failed on the workers or could not be encoded."""

    error_type, http_status = "rpc_error", 500


# -- the registry ---------------------------------------------------------------------------------------------
_TREE: tuple[type[DiffStageError], ...] = tuple(
    cls for cls in list(globals().values()) if isinstance(cls, type) and issubclass(cls, DiffStageError))
# A wire type's owner is the first class of the tree that carries it (ConfigError borrows InvalidRequestError's).
_OWNERS: dict[str, type[DiffStageError]] = {cls.error_type: cls for cls in reversed(_TREE) if cls.error_type}


def registry() -> tuple[type[DiffStageError], ...]:
    """Every class of the tree, the root first, in the order this module defines them."""
    return _TREE


def by_type(error_type: str | None) -> type[DiffStageError] | None:
    """The class that owns a wire type (``"queue_full"`` → QueueFullError); None for a type not of the tree."""
    return _OWNERS.get(error_type or "")


def by_name(name: str) -> type[DiffStageError] | None:
    """The class of the tree with that name (``"ModelLoadError"``), as a rank names its startup failure."""
    return next((cls for cls in _TREE if cls.__name__ == name), None)


def outcome_of(error_type: str | None) -> str:
    """What a request that ended with ``error_type`` counts as: ``completed`` for None (no error), its class's
    outcome, or ``failed`` for a type that gives none."""
    if error_type is None:
        return "completed"
    cls = by_type(error_type)
    return cls.outcome if cls is not None and cls.outcome is not None else "failed"


def from_wire(error_type: str | None, message: str) -> DiffStageError:
    """The exception for an error that arrives as a type and a message (a failed output, a ZMQ ``error``): its
    type's class, or RequestFailedError for a type not of the tree or one whose class needs its ``fields``."""
    cls = by_type(error_type)
    return (RequestFailedError if cls is None or cls.fields else cls)(message)
