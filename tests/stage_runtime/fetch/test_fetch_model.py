"""`stage-runtime fetch-model`: download over real loopback HTTP, verify, unpack, resume, cache, refuse.

The archives hold a small stand-in pipeline folder (model_index.json + a weights file): what fetch-model
does never depends on what is inside (the local-cluster e2e serves a real tiny pipeline fetched this way).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from e2e.file_server import FileServer
from stage_runtime.fetch.cache import ModelCache, hold, release
from stage_runtime.fetch.model import DIGEST_FILE, fetch_model


def pipeline(folder: Path, payload: bytes = b'w' * 300_000) -> Path:
    folder.mkdir(parents=True)
    (folder / 'model_index.json').write_text(json.dumps({'_class_name': 'StableDiffusionPipeline'}))
    (folder / 'unet').mkdir()
    (folder / 'unet' / 'weights.bin').write_bytes(payload)
    return folder


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope='module')
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp('served')
    src = pipeline(root / 'src' / 'tiny')
    with tarfile.open(root / 'tiny.tar.gz', 'w:gz') as tar:
        tar.add(src, arcname='tiny')                              # a single top-level folder
    with tarfile.open(root / 'flat.tar', 'w') as tar:
        for p in sorted(src.rglob('*')):
            tar.add(p, arcname=str(p.relative_to(src)), recursive=False)  # the pipeline at the root
    with zipfile.ZipFile(root / 'tiny.zip', 'w') as z:
        for p in sorted(src.rglob('*')):
            z.write(p, str(p.relative_to(src)))
    (root / 'not-a-model.tar.gz').write_bytes(_targz({'README': b'hello'}))
    (root / 'escape.tar.gz').write_bytes(_targz({'../../etc/evil': b'x'}))
    with FileServer(root) as server:
        yield server, root


def _targz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode='w:gz') as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize('name', ['tiny.tar.gz', 'flat.tar', 'tiny.zip'])
def test_each_archive_kind_becomes_the_pipeline_folder(served, tmp_path, name):
    server, root = served
    got = fetch_model(server.url(name), tmp_path / 'model', sha(root / name))
    model = tmp_path / 'model'
    assert (model / 'model_index.json').is_file() and (model / 'unet' / 'weights.bin').stat().st_size == 300_000
    assert (model / DIGEST_FILE).read_text().strip() == sha(root / name)
    assert got.downloaded and got.requests == 1 and got.size_bytes >= 300_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ['model'], 'no .part or unpack folder left behind'


def test_a_rerun_in_the_same_pod_reuses_the_complete_folder(served, tmp_path):
    server, root = served
    digest = sha(root / 'tiny.tar.gz')
    before = server.gets('tiny.tar.gz')
    fetch_model(server.url('tiny.tar.gz'), tmp_path / 'model', digest)
    again = fetch_model(server.url('tiny.tar.gz'), tmp_path / 'model', digest)
    assert not again.downloaded and server.gets('tiny.tar.gz') == before + 1


def test_a_broken_transfer_resumes_with_a_range_request(served, tmp_path):
    server, root = served
    server.break_first_response('tiny.zip', 100_000)
    got = fetch_model(server.url('tiny.zip'), tmp_path / 'model', sha(root / 'tiny.zip'))
    ranges = [rng for _, path, rng, status in server.access_log if path == '/tiny.zip'][-2:]
    assert got.requests == 2 and ranges[0] is None and ranges[1].startswith('bytes=')
    assert int(ranges[1].removeprefix('bytes=').rstrip('-')) >= 100_000 - 0, ranges
    assert (tmp_path / 'model' / 'unet' / 'weights.bin').stat().st_size == 300_000


def test_a_part_left_by_a_killed_attempt_is_resumed(served, tmp_path):
    server, root = served
    digest = sha(root / 'flat.tar')
    data = (root / 'flat.tar').read_bytes()
    (tmp_path / f'.model.{digest[:16]}.part').write_bytes(data[:5000])
    fetch_model(server.url('flat.tar'), tmp_path / 'model', digest)
    assert server.access_log[-1][2] == 'bytes=5000-' and server.access_log[-1][3] == 206


def test_the_cache_serves_a_second_fetch_without_a_download_and_links_dest(served, tmp_path):
    server, root = served
    digest, cache = sha(root / 'tiny.tar.gz'), tmp_path / 'cache'
    before = server.gets('tiny.tar.gz')
    first = fetch_model(server.url('tiny.tar.gz'), tmp_path / 'pod-a' / 'model', digest, str(cache))
    second = fetch_model(server.url('tiny.tar.gz'), tmp_path / 'pod-b' / 'model', digest, str(cache))
    assert first.downloaded and not second.downloaded and second.requests == 0
    assert server.gets('tiny.tar.gz') == before + 1, 'one GET for two pods on the node'
    for pod in ('pod-a', 'pod-b'):
        link = tmp_path / pod / 'model'
        assert link.is_symlink() and Path(os.path.realpath(link)) == cache / 'models' / digest
    assert not list((cache / 'tmp').iterdir()), 'nothing half-done left in the cache'


def test_a_stage_holds_its_cached_model(served, tmp_path):
    server, root = served
    digest, cache = sha(root / 'tiny.tar.gz'), tmp_path / 'cache'
    fetch_model(server.url('tiny.tar.gz'), tmp_path / 'model', digest, str(cache))
    fd = hold(tmp_path / 'model')
    assert fd is not None and hold(tmp_path / 'elsewhere') is None
    assert ModelCache(cache).evict(0, grace_s=0).removed == [], 'held: never removed'
    release(fd)
    assert ModelCache(cache).evict(0, grace_s=0).removed == [digest]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-m', 'stage_runtime', 'fetch-model', *args], cwd=cwd, text=True,
                          capture_output=True, timeout=120, env={**os.environ, 'PYTHONPATH': os.getcwd()})


def test_cli_wrong_checksum_exits_4_naming_both_digests(served, tmp_path):
    server, root = served
    wrong = '0' * 64
    done = run_cli(server.url('tiny.tar.gz'), str(tmp_path / 'model'), '--sha256', wrong,
                   '--termination-log', str(tmp_path / 'term.log'), cwd=tmp_path)
    line = (tmp_path / 'term.log').read_text().strip()
    assert done.returncode == 4, done.stderr
    assert line.startswith('ChecksumMismatch: ') and wrong in line and sha(root / 'tiny.tar.gz') in line, line
    assert 'spec.model.source.uri.sha256' in line
    assert not (tmp_path / 'model').exists() and not list(tmp_path.glob('.model*')), 'the bad download is gone'


@pytest.mark.parametrize('args, words', [
    (['--sha256', 'abc'], ['sha256=', "'abc'", '64 hex digits']),
    (['--sha256', 'a' * 64, '--max-bytes', '0'], ['max_bytes=0']),
])
def test_cli_bad_input_exits_2_naming_the_field(served, tmp_path, args, words):
    server, _ = served
    done = run_cli(server.url('tiny.tar.gz'), str(tmp_path / 'model'), *args,
                   '--termination-log', str(tmp_path / 'term.log'), cwd=tmp_path)
    line = (tmp_path / 'term.log').read_text()
    assert done.returncode == 2 and line.startswith('ConfigError: fetch-model: ')
    assert all(w in line for w in words), line


def test_cli_refuses_a_non_http_url(tmp_path):
    done = run_cli('file:///etc/passwd', str(tmp_path / 'm'), '--sha256', 'a' * 64, cwd=tmp_path)
    assert done.returncode == 2 and "url='file:///etc/passwd': must be an http:// or https:// URL" in done.stderr


@pytest.mark.parametrize('name, words', [
    ('not-a-model.tar.gz', ['no model_index.json', "['README']"]),
    ('escape.tar.gz', ['outside']),
])
def test_an_archive_that_is_no_pipeline_is_a_config_error(served, tmp_path, name, words):
    server, root = served
    done = run_cli(server.url(name), str(tmp_path / 'model'), '--sha256', sha(root / name),
                   '--termination-log', str(tmp_path / 'term.log'), cwd=tmp_path)
    line = (tmp_path / 'term.log').read_text()
    assert done.returncode == 2 and line.startswith('ConfigError: '), (done.returncode, line)
    assert any(w in line for w in words), line
    assert not (tmp_path / 'model').exists()


def test_cli_success_prints_what_happened(served, tmp_path):
    server, root = served
    done = run_cli(server.url('tiny.tar.gz'), str(tmp_path / 'model'), '--sha256', sha(root / 'tiny.tar.gz'),
                   '--cache', str(tmp_path / 'cache'), '--max-bytes', str(10 ** 9), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report['downloaded'] is True and report['digest'] == sha(root / 'tiny.tar.gz') and report['evicted'] == []
