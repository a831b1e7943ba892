"""The real stage process for the serve tests: spawned once per package (imports cost ~5 s a process).

``STAGE_TOPOLOGY`` is the one switch for the executor the stage runs: the multiprocess executor with two
gloo ranks (CFG-parallel), as in production; ``UNI`` runs everything in the stage process instead.
"""

from __future__ import annotations

import httpx
import pytest
from serve_probes import MP_CFG2, UNI
from stage_process import running_stage

STAGE_TOPOLOGY = MP_CFG2
# Fail-closed tests SIGKILL the last worker /v1/stats reports: a real rank process of the multiprocess
# executor, and for the in-process executor (no worker process) the sentinel executor's stand-in.
# mp-dlo2: two data-parallel ranks that shard the denoiser (DLO); the victim dies inside the block gathers.
FAULT_TOPOLOGIES = {"mp-cfg2": MP_CFG2,
                    "mp-dlo2": ["--device", "cpu", "--num-gpus", "2", "--enable-distributed-layerwise-offload"],
                    "uni-sentinel": ["--device", "cpu", "--executor", "executors_for_tests:SentinelWorkerExecutor"]}
# Small admission limits so 429 is reachable: one running request, two waiting.
SHARED_LIMITS = ["--max-num-seqs", "1", "--max-waiting", "2"]


@pytest.fixture(scope="package")
def stage_topology() -> list[str]:
    return STAGE_TOPOLOGY


@pytest.fixture(params=list(FAULT_TOPOLOGIES))
def fault_topology(request) -> list[str]:
    return FAULT_TOPOLOGIES[request.param]


@pytest.fixture(scope="package")
def shared_stage(tiny_sd_path, tmp_path_factory, stage_topology):
    """One stage for the HTTP and ZMQ route tests; on teardown: SIGTERM → exit 0, nothing left behind."""
    logs = tmp_path_factory.mktemp("shared-stage")
    with running_stage(["--model", tiny_sd_path, *SHARED_LIMITS, *stage_topology], logs / "stage.log") as stage:
        yield stage


@pytest.fixture
def stage(shared_stage):
    """The shared stage, left idle after each test (every test's requests must have ended)."""
    yield shared_stage
    with httpx.Client(base_url=shared_stage.http_url, timeout=10) as client:
        leftover = client.get("/v1/requests").json()["requests"]
        if leftover:
            client.post("/v1/abort", json={"all": True})
        assert not leftover, f"requests still in flight after the test: {leftover}"
