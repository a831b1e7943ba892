"""The end-to-end scenario, written once against a `Driver` (the cluster's hands) so the local cluster
(e2e/local) and kind (e2e/kind) run the same steps: apply the sample → Ready → an image through the
Service → scale → delete → nothing left."""
from __future__ import annotations

import base64
import copy
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / 'manifests' / 'samples' / 'tiny-cpu.yaml'
Obj = dict[str, Any]


class Driver(Protocol):
    namespace: str

    def apply(self, manifest: Obj) -> None: ...
    def stage(self, name: str) -> Obj | None: ...
    def patch_spec(self, name: str, spec: Obj) -> None: ...
    def scale(self, name: str, replicas: int) -> None: ...
    def delete(self, name: str) -> None: ...
    def pods(self, stage: str) -> list[Obj]: ...
    def service_url(self, service: str) -> str | None: ...  # reaches the Service's http port; None: no endpoint


def sample() -> Obj:
    return yaml.safe_load(SAMPLE.read_text())


def wait_for(condition: Callable[[], Any], timeout: float, what: str, detail: Callable[[], Any] = lambda: '',
             poll: float = 0.1) -> Any:
    """The first truthy value of `condition`, asked every `poll` s; past `timeout` an AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f'timed out after {timeout:.0f} s waiting for {what}\n{detail()}')
        time.sleep(poll)
    return result


def status(driver: Driver, name: str) -> Obj:
    return (driver.stage(name) or {}).get('status') or {}


def condition(driver: Driver, name: str, kind: str) -> Obj:
    return next((c for c in status(driver, name).get('conditions') or () if c['type'] == kind), {})


def is_ready(driver: Driver, name: str, replicas: int) -> bool:
    """Ready as Argo CD would call it: the current generation observed, every replica ready."""
    stage = driver.stage(name) or {}
    st = stage.get('status') or {}
    return (st.get('observedGeneration') == stage.get('metadata', {}).get('generation')
            and st.get('phase') == 'Ready' and st.get('readyReplicas') == replicas == st.get('replicas')
            and len(driver.pods(name)) == replicas)


def wait_ready(driver: Driver, name: str, replicas: int, timeout: float) -> Obj:
    def detail() -> str:
        pods = {p['metadata']['name']: p.get('status') or {} for p in driver.pods(name)}
        return yaml.safe_dump({'status': status(driver, name), 'pods': pods})

    wait_for(lambda: is_ready(driver, name, replicas), timeout, f'{name} Ready with {replicas} replicas', detail)
    return status(driver, name)


def replacing(current: Obj, desired: Obj) -> Obj:
    """A JSON merge patch that turns `current` into `desired`: every key `desired` lacks is removed (null)."""
    patch: Obj = {key: None for key in current if key not in desired}
    for key, value in desired.items():
        old = current.get(key)
        patch[key] = replacing(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return patch


def restore(driver: Driver, manifest: Obj, timeout: float) -> Obj:
    """The stage exactly as `manifest` says and Ready, whatever a test before left: a deleted stage is applied
    again (after its deletion ends), a changed spec is patched back (server defaults refill what the patch
    removes, so an unchanged stage is not touched), then Ready with `spec.replicas` replicas. Its status."""
    name = manifest['metadata']['name']
    wait_for(lambda: not ((driver.stage(name) or {}).get('metadata') or {}).get('deletionTimestamp'), timeout,
             f'the deletion of {name} to end')
    current = driver.stage(name)
    if current is None:
        driver.apply(manifest)
    else:
        driver.patch_spec(name, replacing(current['spec'], manifest['spec']))
    return wait_ready(driver, name, manifest['spec'].get('replicas', 1), timeout)


def generate(driver: Driver, service: str, prompt: str = 'a lighthouse', seed: int = 1, steps: int = 4,
             timeout: float = 60) -> bytes:
    """One image through the Service; the PNG bytes (checked to decode as a 64x64 image)."""
    from PIL import Image

    url = wait_for(lambda: driver.service_url(service), 30, f'an endpoint behind Service {service}')
    response = httpx.post(f'{url}/v1/images/generations', timeout=timeout, json={
        'prompt': prompt, 'size': '64x64', 'n': 1, 'seed': seed, 'num_inference_steps': steps})
    assert response.status_code == 200, response.text
    png = base64.b64decode(response.json()['data'][0]['b64_json'])
    image = Image.open(io.BytesIO(png))
    image.load()
    assert (image.format, image.size) == ('PNG', (64, 64)), (image.format, image.size)
    return png


def scale(driver: Driver, name: str, replicas: int, timeout: float) -> Obj:
    driver.scale(name, replicas)
    return wait_ready(driver, name, replicas, timeout)


def delete(driver: Driver, name: str, timeout: float) -> None:
    driver.delete(name)
    wait_for(lambda: driver.stage(name) is None and not driver.pods(name), timeout, f'{name} and its pods gone',
             lambda: [p['metadata']['name'] for p in driver.pods(name)])


def refused_for_gpu_capacity(driver: Driver, gpus_per_node: int, timeout: float) -> Obj:
    """A stage asking for more GPUs per pod than any node has: Accepted=False, no pod, the largest node named."""
    too_big = with_spec(sample(), replicas=1, parallel={'dataParallelSize': 2 * gpus_per_node},
                        resources={'gpusPerPod': 2 * gpus_per_node, 'gpuResourceName': 'nvidia.com/gpu'})
    name = too_big['metadata']['name'] = 'too-big'
    driver.apply(too_big)
    refused = lambda: condition(driver, name, 'Accepted').get('status') == 'False'  # noqa: E731
    wait_for(refused, timeout, 'Accepted=False', lambda: status(driver, name))
    accepted = condition(driver, name, 'Accepted')
    assert accepted['reason'] == 'InsufficientGPUCapacity', accepted
    assert 'the largest is' in accepted['message'] and f'with {gpus_per_node} allocatable' in accepted['message']
    assert not driver.pods(name), 'nothing is created for a stage that fits no node'
    delete(driver, name, timeout)
    return accepted


def with_spec(manifest: Obj, **spec: Any) -> Obj:
    out = copy.deepcopy(manifest)
    out['spec'].update(spec)
    return out
