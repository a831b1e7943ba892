"""`make demo`: the whole system on the embedded local cluster, no Docker, no GPU, no network.

The emulated Kubernetes API, the operator (`python -m stage_operator`, a real process), the pod runner
(each pod's `stage-runtime` containers as local processes): apply manifests/samples/tiny-cpu.yaml, wait
until it is Ready, generate one image through its Service, print `kubectl get dstage`, delete the stage
and stop everything, checking that no process and no /dev/shm segment is left.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from e2e import scenario
from e2e.local.cluster import LocalCluster
from e2e.status_table import render


def run(out: Path, timeout: float) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def step(what: str) -> None:
        print(f'[{time.monotonic() - started:5.1f}s] {what}', flush=True)

    with tempfile.TemporaryDirectory(prefix='diffstage-demo-') as workdir:
        step('starting the local cluster: Kubernetes API emulator, operator process, pod runner')
        with LocalCluster(Path(workdir)) as cluster:
            manifest = scenario.sample()
            name = manifest['metadata']['name']
            cluster.apply(manifest)
            step(f'applied {scenario.SAMPLE.relative_to(scenario.ROOT)}: DiffusionStage/{name}, '
                 f'{manifest["spec"]["replicas"]} replicas; waiting for Ready (models built in init containers)')
            scenario.wait_ready(cluster, name, manifest['spec']['replicas'], timeout)
            step(f'Ready; generating an image through Service/{name}')
            out.write_bytes(scenario.generate(cluster, name, prompt='a watercolor lighthouse at dusk', seed=7,
                                              steps=10))
            print()
            print(f'$ kubectl get dstage   # {cluster.emulator.base_url}')
            print(render(cluster.stages()))
            print()
            step(f'deleting DiffusionStage/{name}')
            scenario.delete(cluster, name, 60)
            scenario.wait_for(lambda: not cluster.runner.running(), 60, 'the pod processes to stop')
        left = cluster.leftovers()
        step('stopped the operator, the pod runner and the API' + (f'; LEFT BEHIND: {left}' if left else
                                                                   ': no process left, no /dev/shm segment left'))
    print(f'image: {out.resolve()}')
    print('       (coloured noise, on purpose: the built-in tiny model has random weights, built here, no download;'
          ' real weights: manifests/samples/gpu-sd-turbo.yaml)')
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog='python -m e2e.local.demo', description=__doc__.splitlines()[0])
    p.add_argument('--out', type=Path, default=Path('.demo/demo.png'))
    p.add_argument('--timeout', type=float, default=300, help='seconds to wait for Ready')
    args = p.parse_args(argv)
    os.environ.setdefault('OMP_NUM_THREADS', '1')  # several torch processes share the cores: one thread each
    os.environ.setdefault('HF_HUB_OFFLINE', '1')
    return run(args.out, args.timeout)


if __name__ == '__main__':
    sys.exit(main())
