"""Startup checks (can this model run in the configured execution and cache mode?) and the admission checks
every request passes before it is queued: the model's facts (``DiffusionRequest.resolve``), the scheduler's
mode, and the serving family's own refusals (its adapter class's ``check_request``)."""

from __future__ import annotations

from collections.abc import Callable

from stage_runtime.config import ExecutionMode, StageConfig
from stage_runtime.engine.limits import check_request_cost
from stage_runtime.engine.prompt_length import PromptLength
from stage_runtime.errors import ConfigError, InvalidRequestError
from stage_runtime.model_info import ModelInfo
from stage_runtime.plugins import import_object
from stage_runtime.request import DiffusionRequest

FamilyCheck = Callable[[DiffusionRequest, ModelInfo], None]


def check_execution_mode(config: StageConfig, info: ModelInfo) -> None:
    """Fail at startup, never silently: step mode needs the step contract, fused batches need batch support."""
    sched = config.scheduler
    if sched.execution_mode == "step" and not info.supports_step_execution:
        why = "streaming_output needs step mode, and " if sched.streaming_output else ""
        raise ConfigError(f"scheduler.execution_mode='step': {why}pipeline {info.pipeline_class} "
                          f"(adapter {info.adapter}) does not implement step execution")
    if sched.execution_mode == "request" and sched.max_num_seqs > 1 and not info.supports_request_batch:
        raise ConfigError(f"scheduler.max_num_seqs={sched.max_num_seqs}: pipeline {info.pipeline_class} cannot "
                          f"fuse requests into one call; use max_num_seqs=1")
    if config.cache.mode == "block" and info.block_cache_refusal:
        raise ConfigError(f"cache.mode='block': {info.block_cache_refusal}; use cache.mode='none'")


def check_request_mode(request: DiffusionRequest, execution_mode: ExecutionMode) -> None:
    """Previews and step checkpoints are step mode's: a 400 naming the field in request mode."""
    if request.sampling.preview_every is not None and execution_mode != "step":
        raise InvalidRequestError("preview_every", request.sampling.preview_every,
                                  "previews need execution_mode=step (or streaming_output)")
    for name in ("resume_from", "save_denoised_to"):
        if getattr(request, name) is not None and execution_mode != "step":
            raise InvalidRequestError(name, getattr(request, name), "step checkpoints need execution_mode=step")


def family_check(info: ModelInfo) -> FamilyCheck:
    """The serving adapter class's ``check_request`` (a classmethod over plain facts), imported from the
    torch-free class that defines it (``info.refusals``, stage_runtime.models.refusals): the engine process
    never loads the pipeline, nor torch and diffusers for this."""
    return import_object(info.refusals).check_request


def admit(request: DiffusionRequest, info: ModelInfo, execution_mode: ExecutionMode, check_family: FamilyCheck,
          max_cost: int | None = None, prompt_length: PromptLength | None = None) -> DiffusionRequest:
    """The request resolved against the model, or InvalidRequestError (400 naming the field) before it is
    queued: what the model's facts rule out, what the mode cannot do, what the family refuses, a prompt the
    encoder would cut (engine.prompt_length), and what costs more than the stage's bound (engine.limits)."""
    resolved = request.resolve(info)
    check_request_mode(resolved, execution_mode)
    check_family(resolved, info)
    if prompt_length is not None:
        prompt_length.check(resolved)
    if max_cost is not None:
        check_request_cost(resolved, max_cost, info)
    return resolved
