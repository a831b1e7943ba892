"""`make demo`: the whole system on the embedded local cluster, no Docker, no GPU, no network.

The emulated Kubernetes API, the operator (`python -m stage_operator`, a real process), the pod runner
(each pod's `stage-runtime` containers as local processes): apply manifests/samples/tiny-digits.yaml (the
trained tiny digits DiT, CFG-parallel over 2 rank processes per pod, 2 replicas), wait until it is Ready, ask
its Service for each digit "0".."9" over HTTP, write the grid PNG, print the judge's score (the share of the
images a digit classifier reads as the digit asked for) and `kubectl get dstage`, delete the stage and stop
everything, checking that no process and no /dev/shm segment is left.
"""
from __future__ import annotations

import argparse
import base64
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from e2e import scenario
from e2e.local.cluster import LocalCluster
from e2e.status_table import render

SAMPLE = scenario.ROOT / 'manifests' / 'samples' / 'tiny-digits.yaml'
DIGITS = tuple(str(d) for d in range(10))


def draw_digits(cluster: LocalCluster, service: str, per_digit: int, seed: int) -> dict[str, np.ndarray]:
    """Each digit through the Service, `per_digit` images each (seeds seed..): uint8 (per_digit, H, W, 3)."""
    from stage_runtime.imageio import decode_image

    url = scenario.wait_for(lambda: cluster.service_url(service), 30, f'an endpoint behind Service {service}')
    images = {}
    for digit in DIGITS:
        response = httpx.post(f'{url}/v1/images/generations', timeout=120,
                              json={'prompt': digit, 'n': per_digit, 'seed': seed})
        assert response.status_code == 200, response.text
        images[digit] = np.stack([decode_image(base64.b64decode(item['b64_json']), 'image', 1 << 20)
                                  for item in response.json()['data']])
    return images


def keep_serving(cluster: LocalCluster, name: str) -> None:
    """`make demo KEEP=1`: the stage stays up for a person to try in a browser, until Ctrl-C."""
    url = cluster.service_url(name)
    print(f'\nThe playground: open {url}/ in a browser (the stage behind Service/{name}).')
    print(f'kubectl: KUBECONFIG={cluster.kubeconfig} kubectl get dstage,pods   (Ctrl-C stops everything)', flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):    # also where a shell started it with SIGINT ignored (a background job)
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1):
        pass
    print()


def run(out: Path, timeout: float, per_digit: int, seed: int, keep: bool = False) -> int:
    from stage_runtime.demo import digit_grid, judge_line
    from stage_runtime.imageio import encode_png

    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def step(what: str) -> None:
        print(f'[{time.monotonic() - started:5.1f}s] {what}', flush=True)

    with tempfile.TemporaryDirectory(prefix='diffstage-demo-') as workdir:
        step('starting the local cluster: Kubernetes API emulator, operator process, pod runner')
        with LocalCluster(Path(workdir)) as cluster:
            manifest = yaml.safe_load(SAMPLE.read_text())
            name = manifest['metadata']['name']
            cluster.apply(manifest)
            step(f'applied {SAMPLE.relative_to(scenario.ROOT)}: DiffusionStage/{name}, '
                 f'{manifest["spec"]["replicas"]} replicas; waiting for Ready (models built in init containers)')
            scenario.wait_ready(cluster, name, manifest['spec']['replicas'], timeout)
            step(f'Ready; drawing the digits 0..9, {per_digit} of each, through Service/{name}')
            images = draw_digits(cluster, name, per_digit, seed)
            out.write_bytes(encode_png(digit_grid(images)))
            step(judge_line(images))
            print()
            print(f'$ kubectl get dstage   # {cluster.emulator.base_url}')
            print(render(cluster.stages()))
            print()
            step(f'the playground page of the stage: {cluster.service_url(name)}/ (make demo KEEP=1 keeps it up)')
            if keep:
                keep_serving(cluster, name)
            step(f'deleting DiffusionStage/{name}')
            scenario.delete(cluster, name, 60)
            scenario.wait_for(lambda: not cluster.runner.running(), 60, 'the pod processes to stop')
        left = cluster.leftovers()
        step('stopped the operator, the pod runner and the API' + (f'; LEFT BEHIND: {left}' if left else
                                                                   ': no process left, no /dev/shm segment left'))
    print(f'grid: {out.resolve()}  (a column per digit 0..9, a row per seed {seed}..{seed + per_digit - 1}; '
          'the trained tiny digits model: docs/trained-model.md)')
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog='python -m e2e.local.demo', description=__doc__.splitlines()[0])
    p.add_argument('--out', type=Path, default=Path('.demo/digits.png'))
    p.add_argument('--timeout', type=float, default=300, help='seconds to wait for Ready')
    p.add_argument('--per-digit', type=int, default=4, help='images of each digit (rows of the grid), 1..16')
    p.add_argument('--seed', type=int, default=0, help="the first row's seed")
    p.add_argument('--keep', action='store_true', help='keep the cluster up after the grid, to try the playground page '
                                                      'in a browser, until Ctrl-C')
    args = p.parse_args(argv)
    if not 1 <= args.per_digit <= 16:
        p.error(f'--per-digit={args.per_digit}: must be 1..16')
    os.environ.setdefault('OMP_NUM_THREADS', '1')  # several torch processes share the cores: one thread each
    os.environ.setdefault('HF_HUB_OFFLINE', '1')
    return run(args.out, args.timeout, args.per_digit, args.seed, args.keep)


if __name__ == '__main__':
    sys.exit(main())
