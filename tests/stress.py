"""The flake finder: run the timing-sensitive test modules N times each, every run in its own pytest process with the
tests shuffled inside the module (pytest-random-order, a new seed each run), with and without a CPU hog busy on
one core, and print pass/fail per test. Exit 0 only when every test passed every time.

    make test-stress                                   # N=5, the default modules, without and with the hog
    .venv/bin/python tests/stress.py --runs 3 --hog on e2e/local/test_local_cluster.py

A test that fails here depends on the machine's speed or on the order of its neighbours: a defect in the test,
or a race in the product that the test has found (docs/testing.md, "The flake finder").
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = (
    'e2e/local/test_local_cluster.py',                       # the local-cluster e2e: scale, kill, abort, delete
    'tests/stage_runtime/executor/test_multiproc_faults.py',  # SIGKILL a worker, the engine; a stalled collective
    'tests/stage_operator/test_operator_live.py',             # the operator against real stages: drains, autoscaling
    'tests/stage_operator/test_operator_restarts.py',         # fail-closed restarts, backoff, budgets
    'tests/stage_operator/test_operator_deletion.py',         # a stage deleted mid-request: the drain, its status
    'tests/stage_runtime/serve/test_lifecycle.py',            # SIGTERM drains, worker death exits 3
)


@contextlib.contextmanager
def cpu_hog(on: bool) -> Iterator[None]:
    """One busy process pinned to the last core (the other core is left to the tests and what they start)."""
    if not on:
        yield
        return
    hog = subprocess.Popen([sys.executable, '-c', 'while True: pass'],
                           preexec_fn=lambda: os.sched_setaffinity(0, {max(os.sched_getaffinity(0))}))
    try:
        yield
    finally:
        hog.kill()
        hog.wait(10)


def run_module(module: str, seed: int) -> tuple[dict[str, str], float, str]:
    """One pytest process over one module, shuffled with `seed`: test id → passed/failed/skipped, the seconds,
    and the tail of its output."""
    with tempfile.TemporaryDirectory(prefix='stress-') as tmp:
        report = Path(tmp) / 'junit.xml'
        started = time.monotonic()
        done = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', module,
                               '--random-order-bucket=module', f'--random-order-seed={seed}',
                               f'--junitxml={report}'], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, 'OMP_NUM_THREADS': '1', 'HF_HUB_OFFLINE': '1'})
        took = time.monotonic() - started
        outcomes: dict[str, str] = {}
        if report.exists():
            for case in ET.parse(report).getroot().iter('testcase'):
                name = f"{module}::{case.get('name')}"
                kinds = {child.tag for child in case}
                outcomes[name] = ('failed' if kinds & {'failure', 'error'} else
                                  'skipped' if 'skipped' in kinds else 'passed')
        if done.returncode not in (0, 1) or not outcomes:
            outcomes[f'{module}::<the pytest run>'] = 'failed'  # crashed, timed out or collected nothing
    return outcomes, took, (done.stdout + done.stderr)[-3000:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('modules', nargs='*', default=list(MODULES))
    parser.add_argument('--runs', type=int, default=5, help='runs of each module in each hog setting')
    parser.add_argument('--hog', choices=('off', 'on', 'both'), default='both')
    parser.add_argument('--seed', type=int, default=None, help='the first shuffling seed (default: random)')
    args = parser.parse_args(argv)
    settings = {'off': [False], 'on': [True], 'both': [False, True]}[args.hog]
    seed = args.seed if args.seed is not None else random.randrange(1, 10 ** 6)
    results: dict[str, dict[bool, list[str]]] = defaultdict(lambda: defaultdict(list))
    print(f'stress: {len(args.modules)} modules x {args.runs} runs x hog {args.hog}; seeds from {seed}; '
          f'{os.cpu_count()} cores', flush=True)
    for hog in settings:
        with cpu_hog(hog):
            for run in range(args.runs):
                for module in random.Random(seed).sample(args.modules, len(args.modules)):
                    outcomes, took, tail = run_module(module, seed)
                    failed = sorted(t for t, o in outcomes.items() if o == 'failed')
                    print(f"  hog {'on ' if hog else 'off'} run {run + 1}/{args.runs} seed {seed:>7} "
                          f"{module}: {len(outcomes) - len(failed)}/{len(outcomes)} passed in {took:.0f} s", flush=True)
                    if failed:
                        print('    failed: ' + ', '.join(t.split('::', 1)[1] for t in failed) + '\n' +
                              '\n'.join('    | ' + line for line in tail.splitlines()[-25:]), flush=True)
                    for test, outcome in outcomes.items():
                        results[test][hog].append(outcome)
                    seed += 1
    width = max(len(t) for t in results) if results else 10
    header = '  '.join(f"{'hog ' + ('on' if h else 'off'):>8}" for h in settings)
    print(f"\n{'test':<{width}}  {header}")
    bad = 0
    for test in sorted(results):
        cells = []
        for hog in settings:
            seen = results[test][hog]
            passed = seen.count('passed') + seen.count('skipped')
            bad += len(seen) - passed
            cells.append(f'{passed}/{len(seen)}'.rjust(8))
        print(f'{test:<{width}}  ' + '  '.join(cells))
    print(f'\n{"every test passed every run" if not bad else f"{bad} failed runs"}')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
