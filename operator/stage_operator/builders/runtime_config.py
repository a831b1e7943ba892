"""What the stage process runs: its `stage.yaml` (stage_runtime.config's shape) and its command line."""

from __future__ import annotations

from typing import Any

from stage_operator.api.meta import (API_KEY_FILE, CONFIG_DIR, CONFIG_FILE, HTTP_PORT, JOBS_DIR, PROFILES_DIR,
                                     TERMINATION_LOG, ZMQ_PORT)
from stage_operator.api.spec import StageSpec
from stage_operator.builders.compile_cache import compile_cache
from stage_operator.builders.model_delivery import model_delivery


def model_dir(spec: StageSpec) -> str:
    """The folder the stage serves, wherever spec.model puts it (builders.model_delivery)."""
    return model_delivery(spec).model_dir


def device(spec: StageSpec) -> str:
    if spec.engine.device:
        return spec.engine.device
    return "cpu" if spec.resources.gpu_resource_name == "" else "auto"


def executor(spec: StageSpec) -> str:
    return spec.engine.executor or ("uni" if spec.topology().world_size == 1 else "mp")


def jobs_config(spec: StageSpec) -> dict[str, Any]:
    """The stage's `jobs:` section (stage_runtime.config.JobsConfig's names): the claim's mount, or the bucket, is
    the store.
    {} without spec.jobs: the stage config of a stage without jobs is what it was (no rollout on upgrade)."""
    if spec.jobs is None:
        return {}
    j, bucket = spec.jobs, spec.jobs.object_store
    store: dict[str, Any] = {"store": JOBS_DIR}
    if bucket is not None:
        store = {"store": bucket.url, **({"endpoint": bucket.endpoint} if bucket.endpoint else {}),
                 **({"region": bucket.region} if bucket.region else {}),
                 **({"presigned_content": True} if j.presigned_content else {})}
    return {"jobs": {**store, "checkpoint_every_steps": j.checkpoint_every_steps,
                     "retention_s": float(j.retention_seconds), "lease_s": float(j.lease_seconds)}}


def compile_config(spec: StageSpec) -> dict[str, Any]:
    """The stage's `compile:` section (stage_runtime.config.CompileConfig's names), with the artifacts in the folder
    builders.compile_cache mounts. {} without spec.compile or with mode none: the stage config of a stage that
    compiles nothing is what it was (no rollout on upgrade)."""
    cache_dir = compile_cache(spec).cache_dir
    if cache_dir is None:
        return {}
    c = spec.compile.runtime(cache_dir)
    section: dict[str, Any] = {"mode": c.mode, "cache_dir": c.cache_dir, "max_graphs": c.max_graphs,
                               "timeout_s": c.timeout_s}
    if c.shapes:
        section["shapes"] = list(c.shapes)
    return {"compile": section}


def quantization_config(spec: StageSpec) -> dict[str, Any]:
    """The stage's `quantization:` section (stage_runtime.config.QuantizationConfig's names). {} without
    spec.quantization or with method none: the stage config of a stage that quantizes nothing is what it was (no
    rollout on upgrade)."""
    if spec.quantization is None or not spec.quantization.enabled:
        return {}
    q = spec.quantization.runtime()
    section: dict[str, Any] = {"method": q.method}
    if q.components:
        section["components"] = list(q.components)
    if q.skip:
        section["skip"] = list(q.skip)
    if q.file is not None:
        section["file"] = q.file
    return {"quantization": section}


def offload_config(spec: StageSpec) -> dict[str, Any]:
    """The stage's `offload:` section (stage_runtime.config.OffloadConfig's names). {} without spec.offload or with
    mode none: the stage config of a stage that offloads nothing is what it was (no rollout on upgrade)."""
    if spec.offload is None or not spec.offload.enabled:
        return {}
    o = spec.offload.runtime()
    section: dict[str, Any] = {"mode": o.mode}
    if o.components:
        section["components"] = list(o.components)
    if o.mode in ("layerwise", "distributed"):
        section.update(resident_layers=o.resident_layers, prefetch=o.prefetch)
    if o.mode == "distributed":
        section["allgather"] = o.allgather
    return {"offload": section}


def sleep_config(spec: StageSpec) -> dict[str, Any]:
    """The stage's `sleep:` section (stage_runtime.config.SleepConfig's names), enabled. {} without spec.sleep: the
    stage config of a stage without sleep mode is what it was (no rollout on upgrade)."""
    if spec.sleep is None:
        return {}
    s = spec.sleep.runtime()
    return {"sleep": {"enabled": True, "level": s.level, "after_idle_s": s.after_idle_s,
                      "drain_timeout_s": s.drain_timeout_s, "wake_timeout_s": s.wake_timeout_s}}


def profiler_config(spec: StageSpec) -> dict[str, Any]:
    """The stage's `profiler:` section (stage_runtime.config.ProfilerConfig's names), the traces in the volume
    builders.pod mounts at PROFILES_DIR. {} without spec.profiling (no rollout on upgrade)."""
    if spec.profiling is None:
        return {}
    p = spec.profiling.runtime(PROFILES_DIR)
    return {"profiler": {"dir": p.dir, "max_seconds": p.max_seconds, "record_shapes": p.record_shapes,
                         "profile_memory": p.profile_memory}}


def stage_config(spec: StageSpec, stage_name: str, loras: Any = None) -> dict[str, Any]:
    """The dict `stage_runtime.config.load_config` accepts (snake_case, its own field names). ``loras``: the startup
    adapters ([{name, path, pinned}]) when not the spec's (the list applied on the replicas: lora_sync)."""
    model: dict[str, Any] = {"path": model_dir(spec), "served_name": spec.model.name or stage_name}
    if spec.model.dtype:
        model["dtype"] = spec.model.dtype
    p = spec.parallel
    scheduler: dict[str, Any] = {"execution_mode": spec.engine.execution_mode, "max_num_seqs": spec.engine.max_num_seqs,
                                 "request_batch_max_wait_ms": spec.engine.request_batch_max_wait_ms,
                                 "streaming_output": spec.engine.streaming}
    if spec.engine.max_waiting:
        scheduler["max_waiting"] = spec.engine.max_waiting
    scheduler["scheduling_policy"] = spec.engine.scheduling_policy
    c, lim = spec.engine.cache, spec.engine.limits
    cache = {"mode": c.mode, "threshold": c.threshold, "warmup_steps": c.warmup_steps, "final_steps": c.final_steps}
    limits = {"max_request_cost": lim.max_request_cost, "stall_unready_s": float(lim.stall_unready_seconds),
              "stall_fail_s": float(lim.stall_fail_seconds)}
    if lim.decode_tile_side is not None:              # only when set: an upgrade rolls no existing stage
        limits["decode_tile_side"] = lim.decode_tile_side
    startup = [lora.wire() for lora in spec.loras or ()] if loras is None else [dict(entry) for entry in loras]
    loras: dict[str, Any] = {"loras": startup} if startup else {}
    if spec.max_loras:
        loras["max_loras"] = spec.max_loras
    return {"model": model, "device": device(spec), "executor": executor(spec), "scheduler": scheduler, **loras,
            "cache": cache, "limits": limits, **jobs_config(spec), **compile_config(spec),
            **quantization_config(spec), **offload_config(spec), **sleep_config(spec), **profiler_config(spec),
            "parallel": {"tensor_parallel_size": p.tensor_parallel_size, "ulysses_degree": p.ulysses_degree,
                         "ring_degree": p.ring_degree, "cfg_parallel_size": p.cfg_parallel_size,
                         "data_parallel_size": p.data_parallel_size, "pipeline_parallel_size": p.pipeline_parallel_size,
                         "num_gpus": spec.resources.gpus_per_pod}}


def serve_command(spec: StageSpec, stage_name: str) -> list[str]:
    """`stage-runtime serve ...` (docs/stage-process.md): explicit flags for what the operator enforces, the rest in
    `--config` (same values: both are derived from the spec), then the user's extraArgs."""
    p = spec.parallel
    cmd = ["stage-runtime", "serve", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}",
           "--model", model_dir(spec), "--served-name", spec.model.name or stage_name,
           "--host", "0.0.0.0", "--http-port", str(HTTP_PORT), "--zmq-port", str(ZMQ_PORT),
           "--device", device(spec), "--num-gpus", str(spec.resources.gpus_per_pod)]
    for flag, value in (("--tensor-parallel-size", p.tensor_parallel_size), ("--ulysses-degree", p.ulysses_degree),
                        ("--ring-degree", p.ring_degree), ("--cfg-parallel-size", p.cfg_parallel_size),
                        ("--data-parallel-size", p.data_parallel_size),
                        ("--pipeline-parallel-size", p.pipeline_parallel_size)):
        if value != 1:
            cmd += [flag, str(value)]
    cmd += ["--executor", executor(spec), "--execution-mode", spec.engine.execution_mode,
            "--max-num-seqs", str(spec.engine.max_num_seqs)]
    if spec.engine.request_batch_max_wait_ms:
        cmd += ["--request-batch-max-wait-ms", str(spec.engine.request_batch_max_wait_ms)]
    if spec.engine.max_waiting:
        cmd += ["--max-waiting", str(spec.engine.max_waiting)]
    cmd += ["--drain-timeout", str(spec.autoscaling.drain_timeout_seconds),
            "--startup-timeout", str(spec.startup_timeout_seconds), "--termination-log", TERMINATION_LOG]
    if spec.auth is not None:  # the Secret's key, mounted by builders.pod
        cmd += ["--api-key-file", API_KEY_FILE]
    if spec.jobs is not None and spec.jobs.claim_name is not None:  # the claim's mount (builders.pod); a flag, so a
        cmd += ["--job-store", JOBS_DIR]                            # runner that maps mounts rewrites it
    if spec.playground is False:
        cmd += ["--no-playground"]
    if spec.profiling is not None:  # its volume's mount, a flag for the same reason (over the config's profiler.dir)
        cmd += ["--profiler-dir", PROFILES_DIR]
    return cmd + list(spec.engine.extra_args)
