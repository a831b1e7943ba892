"""Tier 4 for the FLUX.1 family: `manifests/samples/tiny-flux.yaml` as shipped (`builtin: tiny-flux`, Ulysses 2
on two CPU rank processes) on the embedded local cluster — the init container builds the tiny FluxPipeline,
the stage serves it, a PNG comes back through the Service equal to the bare FluxPipeline call with the same
seed (Ulysses through the whole production path), and deleting the stage leaves nothing behind."""
from __future__ import annotations

import sys

import pytest
import yaml

from e2e import scenario
from e2e.local.cluster import LocalCluster
from e2e.local.pod_process import group_members

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith('linux'),
                       reason='the local pod runner gives each pod a 127.x.y.z address and reads /proc: Linux only'),
    pytest.mark.timeout(240),
]
SAMPLE = scenario.ROOT / 'manifests' / 'samples' / 'tiny-flux.yaml'


def decode(png: bytes):
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert('RGB'))


def bare_flux(folder, prompt: str, steps: int, seed: int):
    """The same tiny FLUX the pod built (make-tiny-model is seeded: identical weights), called bare."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from stage_runtime.models.tiny import make_tiny_model

    pipe = DiffusionPipeline.from_pretrained(make_tiny_model(folder, kind='flux'), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt, height=64, width=64, num_inference_steps=steps, guidance_scale=3.5, output_type='np',
                 generator=torch.Generator().manual_seed(seed)).images[0]
    return (image * 255).round().clip(0, 255).astype(np.uint8)


def max_diff(a, b) -> int:
    return int(abs(a.astype(int) - b.astype(int)).max())


def test_builtin_tiny_flux_stage_serves_a_png_and_leaves_nothing(tmp_path):
    manifest = yaml.safe_load(SAMPLE.read_text())
    name = manifest['metadata']['name']
    with LocalCluster(tmp_path) as cluster:
        cluster.apply(manifest)
        status = scenario.wait_ready(cluster, name, 1, timeout=180)
        assert status['topology']['worldSize'] == 2
        [pod] = cluster.pods(name)
        init = pod['spec']['initContainers'][0]['command']
        assert init[-2:] == ['--kind', 'flux'] and pod['status']['initContainerStatuses'][0]['state'][
            'terminated']['exitCode'] == 0
        first = scenario.generate(cluster, name, prompt='a red fox', seed=5, steps=3)   # a decoded 64x64 PNG
        assert first != scenario.generate(cluster, name, prompt='a red fox', seed=6, steps=3)
        assert max_diff(decode(first), bare_flux(tmp_path / 'tiny-flux', 'a red fox', 3, 5)) <= 2
        scenario.delete(cluster, name, 30)
        scenario.wait_for(lambda: not cluster.runner.running(), 60, 'every pod process to stop', cluster.runner.running)
        assert not group_members(cluster.runner.all_groups), 'no process of the pod is left'
    assert cluster.operator.returncode == 0, cluster.operator_log[-3000:]
    assert 'Traceback' not in cluster.operator_log, cluster.operator_log[-5000:]
    assert not cluster.leftovers(), cluster.leftovers()
