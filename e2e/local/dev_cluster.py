"""`make cluster`: the embedded local cluster kept running for your own kubectl, until Ctrl-C.

The emulated Kubernetes API (CRDs from crds/, admission, OpenAPI, server-side printing), the operator
(`python -m stage_operator`, a real process) and the pod runner (every pod as local processes), with a
kubeconfig written for kubectl. Ctrl-C (or SIGTERM) stops the pods, the operator and the API, then checks
that no pod process and no /dev/shm segment is left (exit 1 if one is). The containers' logs (`kubectl logs`)
stay in `<workdir>/logs`, also across restarts. `make demo` is the one-shot.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from e2e.local.cluster import LocalCluster
from e2e.scenario import SAMPLE

GUIDE = """\
The local cluster is up: Kubernetes API {url} (emulated), the operator and the pod runner.
In another shell:

    export KUBECONFIG={kubeconfig}
    kubectl apply -f {sample}
    kubectl get dstage -w                      # PHASE, READY, REPLICAS, GPUS, RESTARTS, AGE (a row per change)
    kubectl get dstage -o wide                 # + REASON (why the phase), SLEEPING, RANKS (ranks per pod), QUEUED/JOBS
    kubectl wait --for=condition=Ready dstage/tiny --timeout=300s
    kubectl explain dstage.spec.parallel
    curl -s {url}/api/v1/namespaces/{namespace}/services/tiny:http/proxy/v1/images/generations \\
         -H 'Content-Type: application/json' -d '{{"prompt": "a lighthouse", "size": "64x64"}}' | head -c 200
    kubectl logs tiny-0 -f                     # the stage's own log (--tail=N, --timestamps)
    kubectl scale dstage tiny --replicas=3; kubectl describe dstage tiny; kubectl delete dstage tiny

The operator's log: {log}. Every container run's log stays in {logs}/NAMESPACE_POD_UID/CONTAINER/RESTARTS.log,
also after Ctrl-C, which stops everything here.
"""


def run(workdir: Path, namespace: str, port: int | None) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    for entry in workdir.iterdir() if workdir.exists() else ():  # a fresh start; earlier runs' logs are kept
        if entry.name == 'logs':
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    with LocalCluster(workdir, namespace=namespace, port=port) as cluster:
        print(GUIDE.format(url=cluster.emulator.base_url, kubeconfig=cluster.kubeconfig.resolve(), namespace=namespace,
                           sample=SAMPLE.relative_to(Path.cwd()) if SAMPLE.is_relative_to(Path.cwd()) else SAMPLE,
                           log=(workdir / 'operator.log').resolve(), logs=cluster.logs_dir), flush=True)
        stop.wait()
        print('stopping: the pods, the operator, the API ...', flush=True)
    left = cluster.leftovers()
    if left:
        print(f'LEFT BEHIND: {left}', flush=True)
        return 1
    print(f'stopped: no process left, no /dev/shm segment left; the containers\' logs are in {cluster.logs_dir}',
          flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog='python -m e2e.local.dev_cluster', description=__doc__.splitlines()[0])
    p.add_argument('--workdir', type=Path, default=Path('.cluster'),
                   help='kubeconfig, operator log, pod sandboxes (emptied at start), containers\' logs (kept: logs/)')
    p.add_argument('--namespace', default='default', help='the namespace the operator serves')
    p.add_argument('--port', type=int, help='the API port on 127.0.0.1 (default: a free one)')
    args = p.parse_args(argv)
    os.environ.setdefault('OMP_NUM_THREADS', '1')  # several torch processes share the cores: one thread each
    os.environ.setdefault('HF_HUB_OFFLINE', '1')
    return run(args.workdir, args.namespace, args.port)


if __name__ == '__main__':
    sys.exit(main())
