"""Restart reaction time of the real operator process (`python -m stage_operator`) against the emulated API:
from the pod-Failed status write (the watch event) to the replacement pod's create call, with a restart
backoff of 1 s — the acceptance bound is backoff + 1 s.

    A  one stage, its replica failing again and again (sequential restarts)
    B  many stages failing at the same moment (the operator's workers in parallel)

    .venv/bin/python bench/operator_restart.py [--restarts 10] [--stages 20] [--backoff 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import stage_operator  # noqa: F401 (the real package, before tests/stage_operator on sys.path can shadow it)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # e2e.local (the emulated API) and tests/support
from support.kube_emulator import KubeEmulator, running  # noqa: E402

from e2e.local import kubelet  # noqa: E402
from e2e.local.driver import MERGE  # noqa: E402
from stage_operator.api.meta import API_VERSION, PLURAL  # noqa: E402

STAGES = f"/apis/{API_VERSION}/namespaces/default/{PLURAL}"
FAILED = {"status": kubelet.failed("stage", 3, "WorkerDied: worker rank 1 (pid 4242) killed by signal 9",
                                   at="2026-01-01T00:00:00Z")}
RUNNING = {"status": kubelet.running("stage", True)}


def spec(backoff: int, restarts: int) -> dict:
    return {"model": {"builtin": "tiny-sd"}, "replicas": 1, "resources": {"gpusPerPod": 1, "gpuResourceName": ""},
            "restartPolicy": {"maxRestarts": restarts + 1, "windowSeconds": 3600, "backoffInitialSeconds": backoff,
                              "backoffMaxSeconds": backoff}}


def uid(emulator: KubeEmulator, pod: str) -> str | None:
    obj = emulator.get("pods", pod)
    return obj["metadata"]["uid"] if obj else None


def wait(condition, timeout: float, poll: float = 0.005) -> float:
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError("the operator did not react")
        time.sleep(poll)
    return time.perf_counter()


def fail(http: httpx.Client, pod: str) -> None:
    for body in ({"status": {"conditions": None, "containerStatuses": None}}, FAILED):
        r = http.patch(f"/api/v1/namespaces/default/pods/{pod}/status", headers=MERGE, json=body)
        assert r.status_code == 200, r.text


def ready(http: httpx.Client, pod: str) -> None:
    r = http.patch(f"/api/v1/namespaces/default/pods/{pod}/status", headers=MERGE, json=RUNNING)
    assert r.status_code == 200, r.text


def summary(label: str, delays: list[float], backoff: float) -> None:
    over = [d - backoff for d in delays]
    print(f"{label:38}{len(delays):>4}  reaction min {min(delays):.3f}s  median {statistics.median(delays):.3f}s  "
          f"max {max(delays):.3f}s  (over the {backoff:g}s backoff: max {max(over) * 1e3:.0f} ms)")
    assert max(delays) <= backoff + 1, f"slower than backoff + 1 s: {max(delays):.3f}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--stages", type=int, default=20)
    parser.add_argument("--backoff", type=int, default=1)
    args = parser.parse_args()
    print(f"operator_restart: python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}")
    with running() as emulator, httpx.Client(base_url=emulator.base_url, timeout=30) as http, \
            tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "KUBECONFIG": str(emulator.write_kubeconfig(Path(tmp) / "kubeconfig")),
               "OMP_NUM_THREADS": "1"}
        log = open(Path(tmp) / "operator.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "stage_operator", "--namespace", "default", "--standalone",
                                 "--resync-seconds", "30"], env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait(lambda: emulator.watching("diffusionstages") and emulator.watching("pods"), 60, 0.05)
            names = [f"r{i:02d}" for i in range(args.stages)]
            for name in names:
                r = http.post(STAGES, json={"apiVersion": "diffstage.io/v1alpha1", "kind": "DiffusionStage",
                                            "metadata": {"name": name}, "spec": spec(args.backoff, args.restarts)})
                assert r.status_code == 201, r.text
            wait(lambda: all(uid(emulator, f"{n}-0") for n in names), 60, 0.05)
            for name in names:
                ready(http, f"{name}-0")
            sequential = []
            for _ in range(args.restarts):
                before = uid(emulator, "r00-0")
                fail(http, "r00-0")
                t0 = time.perf_counter()
                sequential.append(wait(lambda b=before: uid(emulator, "r00-0") not in (None, b), 10) - t0)
                ready(http, "r00-0")
            before = {n: uid(emulator, f"{n}-0") for n in names[1:]}
            failed_at: dict[str, float] = {}
            for name in names[1:]:
                fail(http, f"{name}-0")
                failed_at[name] = time.perf_counter()
            done: dict[str, float] = {}

            def all_back() -> bool:
                for n in names[1:]:
                    if n not in done and uid(emulator, f"{n}-0") not in (None, before[n]):
                        done[n] = time.perf_counter()
                return len(done) == len(names) - 1
            wait(all_back, 30)
            parallel = [done[n] - failed_at[n] for n in names[1:]]
        finally:
            proc.terminate()
            proc.wait(30)
    summary(f"A. one stage, {args.restarts} restarts in a row", sequential, args.backoff)
    summary(f"B. {args.stages - 1} stages failing at once", parallel, args.backoff)


if __name__ == "__main__":
    main()
