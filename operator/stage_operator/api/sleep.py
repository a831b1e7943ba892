"""`spec.sleep` and `spec.profiling`: the worker controls (the stage config's `sleep:` and `profiler:`,
`stage_runtime.config.SleepConfig` and `ProfilerConfig`).

The bounds and defaults are the runtime's own (read from its config fields), so the CRD never admits what the stage
would refuse at startup. The fields map onto the stage config (builders.runtime_config), only when the object is
given: `sleep` → `sleep: {enabled: true, level, after_idle_s, drain_timeout_s, wake_timeout_s}` (afterIdle, a
duration such as 10m or 1h30m, in seconds); `profiling` → `profiler: {dir, max_seconds, record_shapes,
profile_memory}` with `dir` the volume builders.pod mounts at PROFILES_DIR.
"""

from __future__ import annotations

import math
import re

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stage_operator.api.base import ApiModel, cel, check_exactly_one, exactly_one
from stage_operator.api.model import CacheClaim
from stage_runtime.config import ProfilerConfig, SleepConfig, SleepLevel

_CAMEL = ApiModel.model_config
# Whole hours, minutes and seconds in that order (a subset of Go's time.ParseDuration, which CEL's duration() is)
DURATION_PATTERN = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"
DURATION_MAX_LENGTH = 16
_DURATION = re.compile(DURATION_PATTERN)
_UNIT = {"h": 3600, "m": 60, "s": 1}


def _bounds(model: type[BaseModel], field: str) -> dict[str, float]:
    """ge/gt/le of a runtime config field, as they are (for the seconds of a duration)."""
    out: dict[str, float] = {}
    for m in model.model_fields[field].metadata:
        for name in ("ge", "gt", "le"):
            if isinstance(m, getattr(annotated_types, name.capitalize())):
                out[name] = getattr(m, name)
    return out


def _whole(model: type[BaseModel], field: str) -> dict[str, int]:
    """Whole-second ge/le of a runtime config field (gt becomes ge of the next whole number)."""
    b = _bounds(model, field)
    out = {"le": math.floor(b["le"])}
    out["ge"] = math.floor(b["gt"]) + 1 if "gt" in b else math.ceil(b["ge"])
    return out


def _default(model: type[BaseModel], field: str) -> int:
    return int(model.model_fields[field].default)


AFTER_IDLE_MAX_S = int(_bounds(SleepConfig, "after_idle_s")["le"])  # 7 days


def duration_seconds(text: str) -> int:
    """`1h30m` → 5400; ValueError for anything DURATION_PATTERN does not match (or nothing at all)."""
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        raise ValueError(f"not a duration such as 10m, 90s or 1h30m: {text!r}")
    return sum(int(part[:-1]) * _UNIT[part[-1]] for part in match.groups() if part)


def _after_idle_words(value: str) -> str:
    return (f"sleep.afterIdle {value} is out of range: more than 0s and at most {AFTER_IDLE_MAX_S // 3600}h "
            "(a duration such as 10m, 90s or 1h30m)")


_AFTER_IDLE_RULE = cel(
    f"!has(self.afterIdle) || (duration(self.afterIdle) > duration('0s') && "
    f"duration(self.afterIdle) <= duration('{AFTER_IDLE_MAX_S}s'))",
    "'sleep.afterIdle ' + self.afterIdle + ' is out of range: more than 0s and at most "
    f"{AFTER_IDLE_MAX_S // 3600}h (a duration such as 10m, 90s or 1h30m)'")


class Sleep(ApiModel):
    """Sleep mode: a replica gives its weights' device memory back while idle and wakes on the next request (POST
    /sleep?level=1|2, POST /wake_up, GET /is_sleeping on the stage, behind spec.auth). Given, it is on; absent, the
    stage has no sleep endpoints. A sleeping replica stays Ready and in the Service: a request that reaches it wakes
    it (it waits up to wakeTimeoutSeconds, then 503 with Retry-After). status.sleepingReplicas counts them. Every
    field is a startup setting: changing one rolls the pods."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [_AFTER_IDLE_RULE]})
    after_idle: str | None = Field(None, min_length=2, max_length=DURATION_MAX_LENGTH, pattern=DURATION_PATTERN,
                                   description=(
        "Sleep by itself after this long without work, at `level`: whole hours, minutes and seconds, e.g. 10m, 90s, "
        f"1h30m (more than 0s, at most {AFTER_IDLE_MAX_S // 3600}h). Absent: only POST /sleep puts it to sleep."))
    level: SleepLevel = Field(SleepConfig.model_fields["level"].default, description=(
        "The level auto-sleep uses (POST /sleep names its own). 1 (default): every rank moves its weights to host "
        "memory (pinned on CUDA; size the pod's memory for it) and frees the device's; a fast wake. 2: the weights "
        "are dropped and read again from the model source on wake; a slower wake, no host memory held."))
    drain_timeout_seconds: int = Field(_default(SleepConfig, "drain_timeout_s"),
                                       **_whole(SleepConfig, "drain_timeout_s"), description=(
        "Seconds a sleep waits for the requests running on the replica to finish "
        f"(0-3600, default {_default(SleepConfig, 'drain_timeout_s')})."))
    wake_timeout_seconds: int = Field(_default(SleepConfig, "wake_timeout_s"),
                                      **_whole(SleepConfig, "wake_timeout_s"), description=(
        "Seconds a request that reaches a sleeping replica waits for it to wake; past it the request is answered "
        f"503 with Retry-After (1-3600, default {_default(SleepConfig, 'wake_timeout_s')})."))

    @model_validator(mode="after")
    def _runtime_accepts(self) -> Sleep:
        if self.after_idle is not None:
            seconds = duration_seconds(self.after_idle)
            if not 0 < seconds <= AFTER_IDLE_MAX_S:
                raise ValueError(_after_idle_words(self.after_idle))
        self.runtime()  # the runtime's own checks (a ValueError naming the field), so the stage never refuses it
        return self

    @property
    def after_idle_seconds(self) -> float | None:
        return None if self.after_idle is None else float(duration_seconds(self.after_idle))

    def runtime(self) -> SleepConfig:
        """The stage config's `sleep:` section."""
        return SleepConfig(enabled=True, level=self.level, after_idle_s=self.after_idle_seconds,
                           drain_timeout_s=float(self.drain_timeout_seconds),
                           wake_timeout_s=float(self.wake_timeout_seconds))


class EmptyDirVolume(ApiModel):
    """An emptyDir on the node: the traces go with the pod."""

    size_limit: str | None = Field(None, min_length=1, max_length=64, description=(
        "The emptyDir's size limit, a quantity (e.g. 2Gi); what it holds counts as the pod's ephemeral storage. "
        "Default: none of its own."))


class ProfilesVolume(ApiModel):
    """Where the Chrome traces are written, mounted in the stage container at /var/lib/diffstage/profiles: exactly
    one of emptyDir or pvc. Without it: an emptyDir."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        exactly_one(("emptyDir", "pvc"), "profiling.volume")]})
    empty_dir: EmptyDirVolume | None = None
    pvc: CacheClaim | None = Field(None, description=(
        "A PersistentVolumeClaim the traces are written to, read-write (they outlive the pod); its files are the "
        "stage user's (fsGroup 65532)."))

    @model_validator(mode="after")
    def _one(self) -> ProfilesVolume:
        check_exactly_one(self, ("empty_dir", "pvc"), "profiling.volume")
        return self


class Profiling(ApiModel):
    """The torch profiler on demand: POST /start_profile records every rank into Chrome-trace JSON files (one per
    rank) under /var/lib/diffstage/profiles until POST /stop_profile or maxSeconds (behind spec.auth). Given, it is
    on; absent, those endpoints answer 404. Every field is a startup setting: changing one rolls the pods."""

    max_seconds: int = Field(_default(ProfilerConfig, "max_seconds"), **_whole(ProfilerConfig, "max_seconds"),
                             description=(
        "A profile stops by itself after this many seconds "
        f"(1-3600, default {_default(ProfilerConfig, 'max_seconds')})."))
    record_shapes: bool = Field(False, description="Record the input shapes of each operator (larger traces).")
    profile_memory: bool = Field(False, description="Record tensor memory allocations (larger traces).")
    volume: ProfilesVolume | None = None

    def runtime(self, folder: str) -> ProfilerConfig:
        """The stage config's `profiler:` section, the traces written under `folder`."""
        return ProfilerConfig(dir=folder, max_seconds=float(self.max_seconds), record_shapes=self.record_shapes,
                              profile_memory=self.profile_memory)
