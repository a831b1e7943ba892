"""DiffusionExecutor class resolution and the in-process UniProcExecutor on the real tiny SD pipeline."""

from __future__ import annotations

import pytest

from stage_runtime.config import load_config
from stage_runtime.errors import ConfigError, EngineClosedError, EngineDeadError, ModelLoadError, RpcError
from stage_runtime.executor import DiffusionExecutor
from stage_runtime.executor.uniproc import UniProcExecutor
from stage_runtime.scheduler_output import SchedulerOutput


def cfg(path: str = "/models/unused", **extra):
    return load_config({"model": {"path": path}, "device": "cpu", **extra})


# -- get_class ------------------------------------------------------------------------------------------------
def test_get_class_uni_by_default_for_one_rank():
    config = cfg()
    assert config.resolved_executor == "uni"
    assert DiffusionExecutor.get_class(config) is UniProcExecutor
    assert DiffusionExecutor.get_class(cfg(executor="uni")) is UniProcExecutor


def test_get_class_mp_for_two_ranks():
    from stage_runtime.executor.multiproc import MultiprocExecutor

    config = cfg(parallel={"num_gpus": 2})
    assert config.resolved_executor == "mp"
    assert DiffusionExecutor.get_class(config) is MultiprocExecutor
    assert DiffusionExecutor.get_class(cfg(executor="mp")) is MultiprocExecutor


def test_get_class_rejects_a_class_that_is_not_an_executor():
    with pytest.raises(ConfigError, match=r"executor='stage_runtime.config:StageConfig' is not a DiffusionExecutor"):
        DiffusionExecutor.get_class(cfg(executor="stage_runtime.config:StageConfig"))


def test_get_class_rejects_a_non_class_object():
    with pytest.raises(ConfigError, match="not a DiffusionExecutor subclass"):
        DiffusionExecutor.get_class(cfg(executor="stage_runtime.config:load_config"))


def test_get_class_unimportable_path_is_a_config_error():
    with pytest.raises(ConfigError, match=r"executor='no_such_pkg_xyz.mod:Exec' is not available"):
        DiffusionExecutor.get_class(cfg(executor="no_such_pkg_xyz.mod:Exec"))


def test_get_class_accepts_an_executor_subclass_by_import_path():
    assert DiffusionExecutor.get_class(cfg(executor="stage_runtime.executor.uniproc:UniProcExecutor")) \
        is UniProcExecutor


def test_uni_with_two_ranks_cannot_be_configured():
    with pytest.raises(ConfigError, match="executor='uni' runs exactly one rank but world_size=2"):
        cfg(executor="uni", parallel={"num_gpus": 2})


# -- a real UniProcExecutor -------------------------------------------------------------------------------------
@pytest.fixture
def executor(tiny_sd_path):
    ex = UniProcExecutor(cfg(tiny_sd_path))
    yield ex
    ex.shutdown()


def test_collective_rpc_ping(executor):
    assert executor.collective_rpc("ping") == [0]
    assert executor.collective_rpc("ping", unique_reply_rank=0) == 0
    info = executor.collective_rpc("model_info", unique_reply_rank=0)
    assert info.pipeline_class == "StableDiffusionPipeline"


@pytest.mark.parametrize("method", ["no_such_method", "execute_model", "shutdown", "load_model", "__init__"])
def test_only_declared_control_rpcs_reach_the_worker(executor, method):
    with pytest.raises(RpcError, match=rf"^method='{method}' is not a control RPC; the workers offer: ping, "):
        executor.collective_rpc(method)
    assert executor.collective_rpc("ping") == [0]          # refused before the worker: it still serves
    executor.check_health()


def test_a_failing_control_rpc_is_an_rpc_error_naming_the_cause(executor):
    with pytest.raises(RpcError, match=r"^RPC 'ping' failed on worker rank 0: TypeError: "):
        executor.collective_rpc("ping", args=(1, 2, 3))
    assert executor.collective_rpc("ping") == [0]          # a worker error does not kill the executor
    executor.check_health()


def test_empty_batch_returns_no_outputs(executor):
    assert executor.execute_model(SchedulerOutput(step_id=1)).outputs == {}
    assert executor.execute_model(SchedulerOutput(step_id=2, mode="step")).outputs == {}


def test_mark_dead_fires_each_callback_once(executor):
    seen_a, seen_b, late = [], [], []
    executor.register_failure_callback(seen_a.append)
    executor.register_failure_callback(seen_b.append)
    assert not executor.is_dead
    executor.mark_dead("x")
    executor.mark_dead("y")                                  # latched: no second firing, reason kept
    assert seen_a == ["x"] and seen_b == ["x"]
    assert executor.is_dead
    with pytest.raises(EngineDeadError, match="^x$"):
        executor.check_health()
    executor.register_failure_callback(late.append)          # registered after death: fires at once
    assert late == ["x"]
    assert seen_a == ["x"] and seen_b == ["x"]
    with pytest.raises(EngineDeadError, match="^x$"):
        executor.collective_rpc("ping")


def test_shutdown_twice_is_safe_and_closes(executor):
    executor.shutdown()
    executor.shutdown()
    assert executor.worker is None
    with pytest.raises(EngineClosedError):
        executor.collective_rpc("ping")
    with pytest.raises(EngineClosedError):
        executor.collective_rpc("ping", unique_reply_rank=0)
    with pytest.raises(EngineDeadError, match="closed"):
        executor.check_health()


def test_model_load_failure_raises_and_leaves_no_worker(tmp_path):
    ex = UniProcExecutor.__new__(UniProcExecutor)
    with pytest.raises(ModelLoadError, match="model_index.json"):
        ex.__init__(cfg(str(tmp_path)))
    assert ex.worker is None
    with pytest.raises(EngineClosedError):
        ex.collective_rpc("ping")
