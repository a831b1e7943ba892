"""DiffusionWorker: one rank's device and its model runner. Never admits or reorders requests."""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import torch

from stage_runtime.config import ParallelConfig, StageConfig
from stage_runtime.config.sleep import level_2_refusal
from stage_runtime.control import check_control_rpc
from stage_runtime.distributed.apply import apply_parallelism
from stage_runtime.distributed.groups import ParallelGroups, destroy_distributed, init_distributed, single_rank_groups
from stage_runtime.errors import ConfigError, LoraLoadError
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.registry import resolve_adapter_class
from stage_runtime.outputs import BatchRunnerOutput, ProgressHook
from stage_runtime.scheduler_output import SchedulerOutput
from stage_runtime.worker.model_runner import DiffusionModelRunner
from stage_runtime.worker.profiler import RankProfiler
from stage_runtime.worker.sleep import WeightSleeper

log = logging.getLogger(__name__)


def pick_device(requested: str, local_rank: int, parallel: ParallelConfig) -> torch.device:
    """``auto`` → CUDA when visible, else CPU; one device per rank (local_rank modulo the device count). More ranks
    than visible CUDA devices (``cuda``, or ``auto`` with some but too few) is a topology error: exit 2. The one
    device check: each rank makes it before it loads anything."""
    count = torch.cuda.device_count() if requested != "cpu" and torch.cuda.is_available() else 0
    if requested == "cpu" or (requested == "auto" and count == 0):
        return torch.device("cpu")
    world = parallel.world_size
    if world > count:
        raise ConfigError(f"device={requested!r}: {parallel.describe()} needs {world} CUDA device(s), "
                          f"one per rank, but {count} are visible")
    return torch.device("cuda", local_rank % count)


class DiffusionWorker:
    def __init__(self, config: StageConfig, rank: int = 0, local_rank: int | None = None,
                 progress_hook: ProgressHook | None = None, init_method: str | None = None):
        self.config = config
        self.rank = rank
        self.local_rank = rank if local_rank is None else local_rank
        self.progress_hook = progress_hook
        self.init_method = init_method          # torch.distributed rendezvous (world size > 1 only)
        self.device: torch.device | None = None
        self.groups: ParallelGroups = single_rank_groups()
        self.model_runner: DiffusionModelRunner | None = None
        self.sleeper: WeightSleeper | None = None       # the weights given back while the stage sleeps
        self.profiler: RankProfiler | None = None       # a torch.profiler session, on request

    def init_device(self) -> None:
        """Pick this rank's device; join the process groups when the world has more than one rank."""
        parallel = self.config.parallel
        self.device = pick_device(self.config.device, self.local_rank, parallel)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if parallel.world_size > 1:
            self.groups = init_distributed(parallel, self.rank, self.init_method, self.device,
                                           self.config.collective_timeout_s)
        self.model_runner = DiffusionModelRunner(self.config, self.device, progress_hook=self.progress_hook)
        self.model_runner.writes_checkpoints = self.groups.is_replica_leader     # one writer per replica
        self.model_runner.rank = self.rank
        self.model_runner.groups = self.groups

    def load_model(self) -> ModelInfo:
        info = self.model_runner.load_model(
            parallelize=lambda adapter: apply_parallelism(adapter, self.groups, self.config.parallel))
        self.sleeper = WeightSleeper(self.device, self._read_components, level_2_refusal(self.config))
        self.profiler = RankProfiler(self.rank, self.device)
        return info

    def execute_model(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        if self.profiler is None or not self.profiler.active:
            return self.model_runner.execute_model(sched_out)
        with self.profiler.range(f"execute step={sched_out.step_id} [{','.join(sched_out.scheduled_request_ids)}]"):
            return self.model_runner.execute_model(sched_out)

    def control_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Dispatch a declared control RPC (``stage_runtime.control``); any other name is an RpcError."""
        return getattr(self, check_control_rpc(method))(*args, **(kwargs or {}))

    # -- the control RPCs (stage_runtime.control.CONTROL_RPCS) -------------------------------------------
    def model_info(self) -> ModelInfo:
        return self.model_runner.model_info

    def ping(self) -> int:
        return self.rank

    def worker_info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "dp_rank": self.groups.dp_rank}

    def num_request_states(self) -> int:
        return 0 if self.model_runner is None else self.model_runner.num_request_states()

    def offload_stats(self) -> dict:
        """This rank's offload accounting, for ``collective_rpc("offload_stats")`` (one dict per rank).

        ``{"rank", "mode"}`` plus, when offload is on: ``tier`` ("cpu<->disk" or "cuda<->cpu"), ``units``,
        ``units_resident``, ``units_loading``, ``managed_bytes``, ``resident_bytes`` ({fast tier: bytes,
        slow tier: bytes}, measured from the storages), ``host_held_bytes``, ``peak_resident_bytes``,
        ``max_resident_bytes`` and transfer counters (``loads``, ``releases``, ``evictions``,
        ``bytes_loaded``, ``load_seconds``, ``prefetches``, ``prefetch_hits``, ``prefetch_waits``,
        ``prefetch_skipped``).
        """
        stats = {"mode": "none"} if self.model_runner is None else self.model_runner.offload_stats()
        return {"rank": self.rank, **stats}

    def weight_stats(self) -> dict:
        """This rank's weights (stage_runtime.quantization): ``{"rank", "method", "bytes", "components": {name:
        {"bytes", "method"[, "bytes_as_loaded", "layers_quantized"]}}}``, measured on the storages after loading."""
        stats = {"method": "none", "components": {}, "bytes": 0} if self.model_runner is None else \
            self.model_runner.weight_stats()
        return {"rank": self.rank, **stats}

    def compile_stats(self) -> dict:
        """This rank's compiled denoiser (stage_runtime.compilation): ``{"rank", "mode"}`` plus, when compile is on,
        ``mode_effective``, ``reason``, ``graphs``, ``recompiles``, ``cold_compile_s``, ``cache`` and the rest of
        ``Compiler.stats``."""
        stats = {"mode": "none"} if self.model_runner is None else self.model_runner.compile_stats()
        return {"rank": self.rank, **stats}

    def compile_warmup(self, budget_s: float | None = None) -> dict:
        """The engine's warm-up begins: this rank's compiling is bounded from now (by timeout_s, or ``budget_s``
        when shorter: what the startup budget leaves). This rank's compile stats."""
        stats = {"mode": "none"} if self.model_runner is None else self.model_runner.compile_warmup(budget_s)
        return {"rank": self.rank, **stats}

    def compile_warmed(self) -> dict:
        """The warm-up is over: a graph compiled from now on is a recompile. This rank's compile stats."""
        stats = {"mode": "none"} if self.model_runner is None else self.model_runner.compile_warmed()
        return {"rank": self.rank, **stats}

    def checkpoint_request(self, request_id: str, path: str) -> dict | None:
        """The request's step state to ``path`` (stage_runtime.checkpoint), by its replica's leader alone (the runner's
        ``writes_checkpoints``): every rank of a replica holds the same state, and one writer keeps the file whole."""
        if self.model_runner is None:
            return None
        with self.profiler.range(f"checkpoint [{request_id}]"):
            return self.model_runner.checkpoint(request_id, path)

    # Sleep and wake (engine.sleep_control decides when; every rank together)
    def sleep(self, level: int) -> dict:
        """The rank's weights given back (worker.sleep): ``{"rank", "level", "seconds"}``."""
        return {"rank": self.rank, **self.sleeper.sleep(self._components(), level)}

    def wake_up(self) -> dict:
        """The rank's weights back where they served from: ``{"rank", "level", "seconds"}``."""
        return {"rank": self.rank, **self.sleeper.wake(self._components())}

    def _components(self) -> dict[str, torch.nn.Module]:
        pipe = self.model_runner.adapter.pipe
        return {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}

    def _read_components(self) -> dict[str, torch.nn.Module]:
        """The model source's weights again (level 2's wake), read on the CPU by the family's own load."""
        adapter = resolve_adapter_class(self.config.model).load(self.config.model.path, torch.device("cpu"),
                                                                self.config.model.dtype)
        return {name: m for name, m in adapter.pipe.components.items() if isinstance(m, torch.nn.Module)}

    # The profiler (engine.profiler_control starts and stops it on every rank)
    def start_profile(self, profile_id: str, folder: str, record_shapes: bool = False,
                      profile_memory: bool = False) -> dict:
        started = self.profiler.start(profile_id, folder, record_shapes, profile_memory)
        if "error" not in started:
            self.model_runner.progress_hook = self.profiler.wrap(self.progress_hook)
        return started

    def stop_profile(self) -> dict:
        self.model_runner.progress_hook = self.progress_hook
        return self.profiler.stop()

    # LoRA: the rank's half (the engine's LoraTable decides names, pinning and max_loras).
    def load_lora(self, name: str, path: str, pinned: bool = False) -> dict:
        """Read, check and hold an adapter; its summary, or ``{"error"}`` naming the adapter and key."""
        loras = self._loras()
        try:
            return loras.load(name, path)
        except LoraLoadError as exc:
            return {"error": str(exc)}

    def unload_lora(self, name: str) -> bool:
        return self._loras().unload(name)

    def list_loras(self) -> list[dict]:
        loras = self.model_runner.adapter.loras if self.model_runner and self.model_runner.adapter else None
        return [] if loras is None else loras.list()

    def _loras(self):
        loras = self.model_runner.adapter.loras
        if loras is None:
            raise LoraLoadError(f"{self.model_runner.model_info.pipeline_class} serves no LoRA adapters")
        return loras

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.close()
            self.model_runner = None
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        destroy_distributed()
