"""The node-local cache's eviction: LRU by last use under maxBytes; a model in use (a live process holds its
lock) is never removed; the lock dies with its process; one fetch per digest at a time."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from stage_runtime.fetch.cache import ModelCache, hold

MB = 1_000_000


def put(cache: ModelCache, digest: str, size: int, used_at: float) -> None:
    scratch = cache.scratch(digest)
    scratch.mkdir()
    (scratch / 'model_index.json').write_text('{}')
    (scratch / 'weights.bin').write_bytes(b'x' * size)
    cache.add(digest, scratch)
    cache.touch(digest, at=used_at)


def holder(model_dir: Path) -> subprocess.Popen:
    """Another process (a stage on the node) holding the model, as `stage-runtime serve` does."""
    code = ('import sys, time\nfrom stage_runtime.fetch.cache import hold\n'
            'assert hold(sys.argv[1]) is not None\nprint("held", flush=True)\ntime.sleep(600)\n')
    proc = subprocess.Popen([sys.executable, '-c', code, str(model_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == 'held'
    return proc


def test_three_models_over_budget_evict_the_least_recently_used_unused_one(tmp_path):
    cache = ModelCache(tmp_path / 'cache').ensure()
    now = time.time()
    put(cache, 'a' * 64, MB, now - 3000)   # oldest: in use by a stage
    put(cache, 'b' * 64, MB, now - 2000)   # least recently used of the unused
    put(cache, 'c' * 64, MB, now - 1000)
    stage = holder(cache.entry('a' * 64))
    cache.touch('a' * 64, at=now - 3000)    # and it is still the least recently *started*
    try:
        done = cache.evict(int(2.5 * MB), grace_s=0, now=now)
        assert done.removed == ['b' * 64], done
        assert done.kept_in_use == ['a' * 64]
        assert [d for _, d, _ in cache.entries()] == ['a' * 64, 'c' * 64]
        assert done.total_bytes <= 2.5 * MB
        assert not list(cache.tmp.iterdir()), 'the evicted bytes are gone, not parked'
    finally:
        stage.kill()
        stage.wait()


def test_a_model_in_use_is_never_removed_even_over_budget(tmp_path):
    cache = ModelCache(tmp_path / 'cache').ensure()
    now = time.time()
    put(cache, 'a' * 64, MB, now - 3000)
    put(cache, 'b' * 64, MB, now - 2000)
    stages = [holder(cache.entry('a' * 64)), holder(cache.entry('b' * 64))]
    try:
        done = cache.evict(0, grace_s=0, now=now)
        assert done.removed == [] and done.kept_in_use == ['a' * 64, 'b' * 64] and done.total_bytes > 0
    finally:
        for s in stages:
            s.kill()
            s.wait()
    assert cache.evict(0, grace_s=0, now=time.time() + 1).removed == ['a' * 64, 'b' * 64], 'a dead holder holds nothing'


def test_the_entry_just_fetched_and_entries_in_their_grace_period_stay(tmp_path):
    cache = ModelCache(tmp_path / 'cache').ensure()
    now = time.time()
    put(cache, 'a' * 64, MB, now - 3000)
    put(cache, 'b' * 64, MB, now - 5)       # fetched seconds ago: its stage is about to take the lock
    put(cache, 'c' * 64, MB, now - 4000)
    done = cache.evict(0, keep='c' * 64, grace_s=600, now=now)
    assert done.removed == ['a' * 64] and sorted(done.kept_in_use) == ['b' * 64, 'c' * 64]


def test_a_use_moves_a_model_to_the_back_of_the_queue(tmp_path):
    cache = ModelCache(tmp_path / 'cache').ensure()
    now = time.time()
    put(cache, 'a' * 64, MB, now - 3000)
    put(cache, 'b' * 64, MB, now - 2000)
    fd = hold(cache.entry('a' * 64))        # a stage starts on it: its last use is now

    os.close(fd)
    assert cache.evict(int(1.5 * MB), grace_s=0, now=time.time() + 1).removed == ['b' * 64]


def test_one_fetch_per_digest_at_a_time(tmp_path):
    cache = ModelCache(tmp_path / 'cache').ensure()
    order: list[str] = []

    def fetch(name: str) -> None:
        with cache.fetching('d' * 64):
            order.append(f'{name} in')
            time.sleep(0.2)
            order.append(f'{name} out')

    threads = [threading.Thread(target=fetch, args=(n,)) for n in ('one', 'two')]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order[0].endswith('in') and order[1] == order[0].replace('in', 'out'), order
