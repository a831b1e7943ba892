"""The control RPCs: a closed, declared set that the worker implements, checked before any rank sees it."""

from __future__ import annotations

import inspect

import pytest

from stage_runtime.control import CONTROL_RPCS, check_control_rpc
from stage_runtime.errors import RpcError
from stage_runtime.worker.worker import DiffusionWorker


def test_every_declared_control_rpc_is_a_worker_method():
    for name in CONTROL_RPCS:
        assert inspect.isfunction(getattr(DiffusionWorker, name, None)), name


@pytest.mark.parametrize("method", ["shutdown", "load_model", "init_device", "execute_model", "control_rpc",
                                    "__init__", "__class__", "_private", "", None, 3])
def test_everything_else_is_refused_naming_the_method_and_the_declared_set(method):
    with pytest.raises(RpcError) as info:
        check_control_rpc(method)
    assert str(info.value) == (f"method={method!r} is not a control RPC; the workers offer: "
                               "ping, worker_info, model_info, num_request_states, offload_stats, weight_stats, compile_stats, "
                               "compile_warmup, compile_warmed, load_lora, unload_lora, list_loras, "
                               "checkpoint_request, sleep, wake_up, start_profile, stop_profile")


def test_the_worker_refuses_undeclared_names_itself():
    worker = DiffusionWorker.__new__(DiffusionWorker)        # no device: the check comes first
    with pytest.raises(RpcError, match="method='shutdown' is not a control RPC"):
        worker.control_rpc("shutdown")
