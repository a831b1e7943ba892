"""The control RPCs the workers offer: a closed, documented set.

``collective_rpc(method)`` (engine, executor, ``StageService``, ZMQ ``collective_rpc``) accepts only these
names; any other — ``shutdown``, ``load_model``, ``__init__``, a typo — is an :class:`RpcError` raised
before anything reaches a rank, and the workers check again before they dispatch. Model execution is
not a control RPC: it is its own message kind (``executor.messages.ExecuteModel``), which no network
client can send. A feature that needs a new control RPC adds it here, with its reply, and implements it
on ``DiffusionWorker`` (a test holds the two in agreement).
"""

from __future__ import annotations

from stage_runtime.errors import RpcError

# name → what each rank answers (one reply per rank, or rank ``unique_reply_rank``'s alone)
CONTROL_RPCS: dict[str, str] = {
    "ping": "the rank number",
    "worker_info": '{"rank", "pid", "device", "dp_rank"}',
    "model_info": "the loaded model's ModelInfo (its family's facts)",
    "num_request_states": "per-request state the rank holds (0 when idle)",
    "offload_stats": "the rank's weight-offload accounting",
    "weight_stats": "the rank's weights: {rank, method, bytes, components: {name: {bytes, method, ...}}}",
    "compile_stats": "the rank's compiled denoiser: {rank, mode, mode_effective, reason, graphs, recompiles, ...}",
    "compile_warmup": "(budget_s) the engine's warm-up begins: the rank bounds its compiling from now; its compile stats",
    "compile_warmed": "the engine's compile warm-up is over (later graphs are recompiles); the rank's compile stats",
    # LoRA management: the engine's adapter table answers (engine.lora_table), then tells every rank
    "load_lora": "(name, path[, pinned]) → the adapter {name, path, digest, pinned, rank, modules, ...}; a rank "
                 "answers its summary or {error} when the file does not fit",
    "unload_lora": "(name) → {name, unloaded}; a rank answers whether it held the adapter",
    "list_loras": "the resident adapters (the engine's view); a rank answers its own summaries",
    # Step checkpoints (step mode): run between ticks, written by the leader of the replica holding the request
    "checkpoint_request": "(request_id, path) → the leader holding the request's step state writes it to path: "
                          "{path, step, total_steps, bytes, seconds}, or {error}; None from every other rank; "
                          "path None: the file's bytes as data, nothing written (the caller writes them)",
    # Sleep mode (engine.sleep_control): every rank together, between ticks, with nothing running
    "sleep": "(level) → the rank gives its weights back (1: to host memory, 2: dropped): {rank, level, seconds}",
    "wake_up": "the rank's weights back (level 2: read again from the model source): {rank, level, seconds}",
    # The profiler (engine.profiler_control)
    "start_profile": "(profile_id, folder, record_shapes, profile_memory) → torch.profiler records on the rank: "
                     "{rank, profile_id, pid}, or {error}",
    "stop_profile": "the rank's trace written: {rank, profile_id, path, bytes, seconds}, or {error}",
}


def check_control_rpc(method: object) -> str:
    """``method`` when it is a declared control RPC; otherwise RpcError naming it and the declared set."""
    if not isinstance(method, str) or method not in CONTROL_RPCS:
        raise RpcError(f"method={method!r} is not a control RPC; the workers offer: {', '.join(CONTROL_RPCS)}")
    return method
