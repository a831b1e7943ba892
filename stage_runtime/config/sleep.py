"""Sleep mode and the profiler (parts of :mod:`stage_runtime.config`; the runtime is ``stage_runtime.sleep`` and
``stage_runtime.profiling``; docs/sleep-and-profile.md).

``sleep``: off unless ``enabled`` (``serve --enable-sleep-mode``; the CRD's ``spec.sleep``). A sleeping stage keeps
its process, compiled graphs, LoRA adapters, prompt cache and queued work, and gives its weights' memory back:

- ``level`` 1: every rank moves its weights to host memory (pinned on CUDA) and frees the device's, allocator cache
  included.
- ``level`` 2: the weights are dropped and read again on wake from the model source the stage loaded.

``after_idle_s``: the stage sleeps itself after that long without work (None: only ``POST /sleep``), at ``level``.
``drain_timeout_s`` bounds how long a sleep waits for running requests; ``wake_timeout_s`` how long a request that
reaches a sleeping stage waits for it to wake (past it: 503 with ``Retry-After``).

``profiler``: off unless ``dir`` is set (``serve --profiler-dir DIR``; ``spec.profiling``). ``POST /start_profile``
records ``torch.profiler`` on every rank into Chrome-trace JSON files under ``dir``; a profile stops by itself after
``max_seconds``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SleepLevel = Literal[1, 2]
_FROZEN = ConfigDict(frozen=True, extra="forbid")


class SleepConfig(BaseModel):
    model_config = _FROZEN
    enabled: bool = False
    level: SleepLevel = 1                    # what auto-sleep uses (POST /sleep names its own)
    after_idle_s: float | None = Field(None, gt=0, le=7 * 86400, allow_inf_nan=False)
    drain_timeout_s: float = Field(30.0, ge=0, le=3600, allow_inf_nan=False)
    wake_timeout_s: float = Field(120.0, gt=0, le=3600, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fields_need_enabled(self) -> SleepConfig:
        defaults = {n: f.default for n, f in type(self).model_fields.items() if n != "enabled"}
        set_fields = sorted(n for n, d in defaults.items() if getattr(self, n) != d)
        if not self.enabled and set_fields:
            raise ValueError(f"sleep.{set_fields[0]} is set but sleep.enabled is false; enable sleep mode "
                             "(serve --enable-sleep-mode)")
        return self


class ProfilerConfig(BaseModel):
    model_config = _FROZEN
    dir: str | None = Field(None, min_length=1)      # None: the profiler endpoints answer 404
    max_seconds: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False)
    record_shapes: bool = False
    profile_memory: bool = False

    @property
    def enabled(self) -> bool:
        return self.dir is not None


def level_2_refusal(config) -> str | None:
    """Why level 2 cannot drop this stage's weights (they are not what the folder holds), or None."""
    if config.quantization.method != "none":
        return f"the weights are quantized (quantization.method={config.quantization.method!r})"
    if config.parallel.tensor_parallel_size > 1:
        return f"each rank holds a tensor-parallel shard (tensor_parallel_size={config.parallel.tensor_parallel_size})"
    if config.offload.mode != "none":
        return f"the offloader holds the weights (offload.mode={config.offload.mode!r})"
    return None
