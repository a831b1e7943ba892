"""Cold vs cached model delivery: `stage-runtime fetch-model` (the init container's command, a real process)
over a loopback HTTP server, for an archive of incompressible weights; cold = an empty node cache (download,
verify, unpack), cached = a second pod on the node (the cache has it: link only). Side by side in one run,
min–max over the runs, and the ratio.

    .venv/bin/python bench/model_fetch.py [--mb 256] [--runs 3]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.file_server import FileServer  # noqa: E402


def archive(folder: Path, mb: int) -> Path:
    model = folder / 'model'
    (model / 'unet').mkdir(parents=True)
    (model / 'model_index.json').write_text('{"_class_name": "StableDiffusionPipeline"}')
    with (model / 'unet' / 'diffusion_pytorch_model.safetensors').open('wb') as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    served = folder / 'served'
    served.mkdir()
    with tarfile.open(served / 'model.tar', 'w') as tar:
        tar.add(model, arcname='model')
    return served / 'model.tar'


def fetch(url: str, dest: Path, digest: str, cache: Path) -> tuple[float, dict]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, '-m', 'stage_runtime', 'fetch-model', url, str(dest), '--sha256', digest,
                           '--cache', str(cache)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, 'PYTHONPATH': str(ROOT)}, check=True)
    return time.perf_counter() - started, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--mb', type=int, default=256)
    parser.add_argument('--runs', type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix='fetch-bench-') as tmp:
        tmp = Path(tmp)
        tar = archive(tmp, args.mb)
        digest = hashlib.sha256(tar.read_bytes()).hexdigest()
        size = tar.stat().st_size
        cold, cached = [], []
        with FileServer(tar.parent) as server:
            for run in range(args.runs):
                cache = tmp / f'cache-{run}'
                seconds, report = fetch(server.url(tar.name), tmp / f'pod-a-{run}' / 'model', digest, cache)
                assert report['downloaded']
                cold.append(seconds)
                seconds, report = fetch(server.url(tar.name), tmp / f'pod-b-{run}' / 'model', digest, cache)
                assert not report['downloaded']
                cached.append(seconds)
            gets = server.gets(tar.name)
    print(f'model archive: {size / 1e6:.0f} MB (incompressible), {args.runs} runs, '
          f'{gets} GETs in all (one per cold fetch)')
    print(f'cold   (download + sha256 + unpack): {min(cold):6.2f}–{max(cold):6.2f} s')
    print(f'cached (second pod on the node):     {min(cached):6.2f}–{max(cached):6.2f} s   (a process start + a link)')
    print(f'cold / cached (medians): {sorted(cold)[len(cold) // 2] / sorted(cached)[len(cached) // 2]:.1f}x')


if __name__ == '__main__':
    main()
