"""`make e2e-kind`: create a kind cluster, give its workers fake GPU capacity, build and load the images,
apply manifests/overlays/kind, run the scenario (e2e/scenario.py, the same steps as the local cluster e2e)
with kubectl and the Python client, and delete the cluster. Without Docker or kind it says why and exits 0.

    python -m e2e.kind.run [--keep] [--name diffstage-e2e]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_GPUS = '8'
TAG = '0.1.0'  # manifests/overlays/kind and the CRD's default runtime image use it


def missing() -> str | None:
    """Why this machine cannot run a kind cluster, or None."""
    absent = [tool for tool in ('docker', 'kind', 'kubectl') if shutil.which(tool) is None]
    if absent:
        return f'{" and ".join(absent)} not installed (kind runs Kubernetes in Docker containers)'
    info = subprocess.run(['docker', 'info'], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return "the Docker daemon is not reachable ('docker info' failed)"
    return None


def run(*argv: str, timeout: float = 900, **kwargs) -> str:
    print('+', ' '.join(argv), flush=True)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if out.returncode != 0:
        raise RuntimeError(f'{" ".join(argv)} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-3000:]}')
    return out.stdout


def fake_gpus() -> None:
    """Extended resources on node status: the scheduler counts them, no device plugin needed."""
    nodes = json.loads(run('kubectl', 'get', 'nodes', '-o', 'json'))['items']
    patch = json.dumps([{'op': 'add', 'path': f'/status/{field}/nvidia.com~1gpu', 'value': FAKE_GPUS}
                        for field in ('capacity', 'allocatable')])  # the kubelet derives the same on its next sync
    for node in nodes:
        if 'node-role.kubernetes.io/control-plane' not in node['metadata'].get('labels', {}):
            run('kubectl', 'patch', 'node', node['metadata']['name'], '--subresource=status', '--type=json',
                '-p', patch)


def scenario_on_kind() -> None:
    from e2e import scenario
    from e2e.kind.driver import KindDriver
    from e2e.status_table import render

    driver = KindDriver()
    try:
        manifest = scenario.sample()
        name = manifest['metadata']['name']
        driver.apply(manifest)
        scenario.wait_ready(driver, name, manifest['spec']['replicas'], timeout=600)
        png = scenario.generate(driver, name)
        print(f'image through Service/{name}: {len(png)} bytes of PNG')
        scenario.scale(driver, name, 3, timeout=600)
        scenario.scale(driver, name, 1, timeout=300)
        scenario.generate(driver, name)
        print(render(driver.stages()))
        scenario.refused_for_gpu_capacity(driver, int(FAKE_GPUS), timeout=120)
        scenario.delete(driver, name, 300)
    finally:
        driver.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog='python -m e2e.kind.run', description=__doc__.splitlines()[0])
    p.add_argument('--name', default=os.environ.get('KIND_CLUSTER', 'diffstage-e2e'))
    p.add_argument('--keep', action='store_true', help='leave the cluster running afterwards')
    args = p.parse_args(argv)
    if why := missing():
        print(f'make e2e-kind: skipped: {why}')
        return 0
    workdir = Path(tempfile.mkdtemp(prefix='diffstage-kind-'))
    kubeconfig = workdir / 'kubeconfig'
    os.environ['KUBECONFIG'] = str(kubeconfig)  # kubectl and the Python client talk to this cluster only
    run('kind', 'create', 'cluster', '--name', args.name, '--config', str(ROOT / 'e2e' / 'kind' / 'cluster.yaml'),
        '--kubeconfig', str(kubeconfig), '--wait', '180s')
    try:
        fake_gpus()
        run('bash', str(ROOT / 'images' / 'build.sh'), env={**os.environ, 'TAG': TAG, 'SKIP_CUDA': '1'}, timeout=3600)
        run('kind', 'load', 'docker-image', '--name', args.name,
            f'diffstage/runtime:{TAG}', f'diffstage/operator:{TAG}')
        run('kubectl', 'apply', '--server-side', '-k', str(ROOT / 'manifests' / 'overlays' / 'kind'))
        run('kubectl', '-n', 'diffstage-system', 'rollout', 'status', 'deployment/diffstage-operator', '--timeout=300s')
        scenario_on_kind()
        print('make e2e-kind: passed')
        return 0
    finally:
        if args.keep:
            print(f'kept: kind cluster {args.name} (KUBECONFIG={kubeconfig}); `kind delete cluster --name {args.name}`')
        else:
            run('kind', 'delete', 'cluster', '--name', args.name)
            shutil.rmtree(workdir)


if __name__ == '__main__':
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
