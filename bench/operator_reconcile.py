"""Operator reconcile cost against the emulated Kubernetes API: 100 stages, cold and steady state.

    A  the reconcile path in-process (kube.Kube → reconcile → apply, what the kopf worker runs), stage by
       stage: reconciles/s, API calls and writes per reconcile, CPU-ms per reconcile (the reconciling
       thread's CPU only; the emulator runs in another thread), cold (create everything) vs steady (nothing
       to do: zero writes).
    B  the real operator process (`python -m stage_operator`) against the same emulator: time until 100
       stages are Ready, steady-state reconciles/s and CPU-ms per reconcile from /proc, peak RSS (VmHWM),
       mutating calls in steady state (must be 0).

    .venv/bin/python bench/operator_reconcile.py [--stages 100] [--resync 2] [--steady-seconds 6]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import stage_operator  # noqa: F401 (the real package, before tests/stage_operator on sys.path can shadow it)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from e2e.local.kube_emulator import KubeEmulator, running  # noqa: E402

from stage_operator.controller import Controller  # noqa: E402
from stage_operator.kube import Kube  # noqa: E402

STAGES = "/apis/diffstage.io/v1alpha1/namespaces/default/diffusionstages"
MERGE = {"Content-Type": "application/merge-patch+json"}
SPEC = {"model": {"builtin": "tiny-sd"}, "replicas": 1, "resources": {"gpusPerPod": 1, "gpuResourceName": ""}}
READY = {"status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"},
                                                        {"type": "Ready", "status": "True"}]}}


def create_stages(http: httpx.Client, n: int) -> list[str]:
    names = [f"stage-{i:03d}" for i in range(n)]
    for name in names:
        r = http.post(STAGES, json={"apiVersion": "diffstage.io/v1alpha1", "kind": "DiffusionStage",
                                    "metadata": {"name": name}, "spec": SPEC})
        assert r.status_code == 201, r.text
    return names


def kubelet(http: httpx.Client, emulator: KubeEmulator) -> int:
    pods = [p["metadata"]["name"] for p in emulator.objects("pods", "default")]
    for name in pods:
        response = http.patch(f"/api/v1/namespaces/default/pods/{name}/status", headers=MERGE, json=READY)
        assert response.status_code == 200, response.text
    return len(pods)


def round_robin(controller: Controller, emulator: KubeEmulator, names: list[str]) -> dict[str, float]:
    calls0, writes0 = controller.kube.calls, emulator.mutation_count
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for name in names:
        controller.reconcile_once("default", name)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    n = len(names)
    return {"reconciles_per_s": n / wall, "calls_per_reconcile": (controller.kube.calls - calls0) / n,
            "writes_per_reconcile": (emulator.mutation_count - writes0) / n, "cpu_ms_per_reconcile": cpu * 1e3 / n,
            "wall_ms_per_reconcile": wall * 1e3 / n}


def section_a(n: int) -> None:
    with running() as emulator, httpx.Client(base_url=emulator.base_url, timeout=30) as http:
        names = create_stages(http, n)
        controller = Controller(Kube(emulator.api_client()))
        cold = round_robin(controller, emulator, names)
        kubelet(http, emulator)
        converge = round_robin(controller, emulator, names)
        steady = [round_robin(controller, emulator, names) for _ in range(3)]
        assert all(s["writes_per_reconcile"] == 0 for s in steady), steady
    print(f"\nA. reconcile path in-process, {n} stages (1 replica each)")
    print(f"{'':24}{'reconciles/s':>14}{'calls/rec':>11}{'writes/rec':>12}{'CPU-ms/rec':>12}{'wall-ms/rec':>13}")
    best = max(steady, key=lambda s: s["reconciles_per_s"])
    for label, row in (("cold (create all)", cold), ("pods ready (status)", converge), ("steady (best of 3)", best)):
        print(f"{label:24}{row['reconciles_per_s']:>14.0f}{row['calls_per_reconcile']:>11.1f}"
              f"{row['writes_per_reconcile']:>12.1f}{row['cpu_ms_per_reconcile']:>12.2f}"
              f"{row['wall_ms_per_reconcile']:>13.2f}")


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _stage_gets(emulator: KubeEmulator) -> int:
    return sum(1 for r in emulator._requests if r.method.value == "GET" and r.name
               and r.resource is not None and r.resource.plural == "diffusionstages")


def wait(condition, timeout: float) -> float:
    t0 = time.perf_counter()
    while not condition():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("the operator did not converge")
        time.sleep(0.05)
    return time.perf_counter() - t0


def section_b(n: int, resync: float, steady_seconds: float) -> None:
    with running() as emulator, httpx.Client(base_url=emulator.base_url, timeout=30) as http, \
            tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "KUBECONFIG": str(emulator.write_kubeconfig(Path(tmp) / "kubeconfig")),
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "stage_operator", "--namespace", "default", "--standalone",
                                 "--resync-seconds", str(resync)], env=env, stdout=subprocess.DEVNULL,
                                stderr=open(Path(tmp) / "operator.log", "w"))
        try:
            wait(lambda: emulator.watching("diffusionstages") and emulator.watching("pods"), 60)
            idle_rss = _peak_rss_mb(proc.pid)
            cpu0, t0 = _proc_cpu_s(proc.pid), time.perf_counter()
            create_stages(http, n)
            wait(lambda: len(emulator.objects("pods", "default")) == n, 120)
            kubelet(http, emulator)

            def all_ready() -> bool:
                return all((o.get("status") or {}).get("phase") == "Ready" for o in emulator.objects("dstage"))
            wait(all_ready, 120)
            cold_s, cold_cpu = time.perf_counter() - t0, _proc_cpu_s(proc.pid) - cpu0
            time.sleep(resync)  # let the last status writes settle
            emulator.reset_counts()
            gets0, cpu0, t0 = _stage_gets(emulator), _proc_cpu_s(proc.pid), time.perf_counter()
            time.sleep(steady_seconds)
            wall = time.perf_counter() - t0
            reconciles, cpu = _stage_gets(emulator) - gets0, _proc_cpu_s(proc.pid) - cpu0
            mutations, peak = emulator.mutation_count, _peak_rss_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"\nB. the operator process (kopf, python -m stage_operator), {n} stages, resync every {resync:g}s")
    print(f"cold: create {n} stages → all Ready in {cold_s:.2f}s (includes the kubelet patches), "
          f"operator CPU {cold_cpu:.2f}s = {cold_cpu * 1e3 / n:.1f} CPU-ms per stage")
    print(f"steady ({wall:.1f}s): {reconciles / wall:.0f} reconciles/s (paced by the resync: {n / resync:.0f}/s), "
          f"{cpu * 1e3 / max(reconciles, 1):.2f} CPU-ms per reconcile (operator process: kopf + client), "
          f"mutating calls: {mutations}")
    print(f"peak RSS: {peak:.0f} MiB ({idle_rss:.0f} MiB idle before the stages)")
    assert mutations == 0, f"steady state made {mutations} mutating calls"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=100)
    parser.add_argument("--resync", type=float, default=2.0)
    parser.add_argument("--steady-seconds", type=float, default=6.0)
    args = parser.parse_args()
    print(f"operator_reconcile: python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}")
    section_a(args.stages)
    section_b(args.stages, args.resync, args.steady_seconds)
    print(f"\nbench process peak RSS (emulator + in-process reconciles): "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
