"""The errors diffstage raises on purpose, as one tree.

    DiffStageError
    ├── ConfigError            bad configuration or topology        CLI exit 2, HTTP 400
    │   └── LoraLoadError          a LoRA file refused (names adapter + key)  exit 2 at startup, HTTP 400
    ├── ModelLoadError         the model folder cannot be served    CLI exit 2
    ├── RequestError           one request's fault; never the engine's
    │   ├── InvalidRequestError    bad parameters                   HTTP 400 (names the field)
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
"""


class DiffStageError(Exception):
    """Root of every error diffstage raises on purpose."""


class ConfigError(DiffStageError, ValueError):
    """Bad configuration or parallel topology (a stage exits 2 on it)."""


class LoraLoadError(ConfigError):
    """A LoRA adapter file that cannot be applied to the served model; the message names the adapter and
    the first key that does not fit (exit 2 for a startup adapter, HTTP 400 for ``POST /v1/loras``)."""


class ModelLoadError(DiffStageError):
    """The model folder is missing, unreadable, or its pipeline is not supported."""


class RequestError(DiffStageError):
    """A failure that belongs to one request."""

    error_type = "request_error"


class InvalidRequestError(RequestError, ValueError):
    """Bad request parameters; ``field`` names the offending one."""

    error_type = "invalid_request_error"

    def __init__(self, field: str, value: object, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field}={value!r}: {reason}")


class RequestTooLargeError(RequestError, ValueError):
    """An upload over the configured bytes or pixels (HTTP 413); ``field`` names the part."""

    error_type = "request_too_large"

    def __init__(self, field: str, reason: str):
        self.field = field
        super().__init__(f"{field}: {reason}")


class UnauthorizedError(RequestError):
    """A ``/v1/*`` call without a valid ``Authorization: Bearer`` key when API keys are on (HTTP 401)."""

    error_type = "unauthorized"


class DuplicateRequestError(RequestError, ValueError):
    error_type = "duplicate_request_id"


class QueueFullError(RequestError):
    error_type = "queue_full"


class RequestAbortedError(RequestError):
    error_type = "request_aborted"


class DeadlineExceededError(RequestError):
    """The request's ``timeout_s`` passed: it ended unrun (queued) or at the next step (running)."""

    error_type = "deadline_exceeded"


class LoraConflictError(RequestError):
    """A LoRA management call that conflicts with the resident set: unloading an adapter in-flight requests
    use, loading a name that is taken, or ``max_loras`` reached with every resident adapter pinned or in use."""

    error_type = "lora_conflict"


class LoraNotFoundError(RequestError):
    """``DELETE /v1/loras/{name}`` for a name that is not loaded."""

    error_type = "not_found"


class RequestFailedError(RequestError):
    error_type = "request_failed"


class EngineClosedError(DiffStageError, RuntimeError):
    error_type = "engine_closed"


class EngineDeadError(DiffStageError, RuntimeError):
    """A worker died or a collective failed: the engine is latched dead (fail closed)."""

    error_type = "engine_dead"


class EngineStartupError(DiffStageError, RuntimeError):
    """The engine could not start (e.g. the warmup request failed); it was closed again."""

    error_type = "engine_startup"


class StartupTimeoutError(EngineStartupError):
    """The stage was not ready within its startup budget (``--startup-timeout``); the message names the phase."""

    error_type = "startup_timeout"


class ModelFetchError(DiffStageError, RuntimeError):
    """``fetch-model`` could not deliver the model (network, HTTP status, disk): worth a retry."""


class ChecksumMismatchError(ModelFetchError):
    """The downloaded archive's SHA-256 differs from the one asked for (``--sha256``)."""


class WorkerFatalError(DiffStageError, RuntimeError):
    """Raised inside a worker rank when it cannot continue (e.g. a collective failed or timed out).

    The runner never turns it into a per-request error: the rank reports it and exits, and the
    executor fails closed (every in-flight request then ends with EngineDeadError).
    """

    error_type = "worker_fatal"


class StageUnavailableError(DiffStageError, RuntimeError):
    """The stage process is starting or draining: it admits nothing now (another replica may)."""

    error_type = "stage_unavailable"


class RpcError(DiffStageError, RuntimeError):
    """A control RPC (``collective_rpc``) failed on the workers or could not be encoded."""

    error_type = "rpc_error"
