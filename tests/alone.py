"""Every test module on its own: one pytest process per module, its tests shuffled (pytest-random-order, one seed
per module), two modules at a time. A module that passes in the suite but fails here needs something that another
module left behind: a defect in the test (docs/testing.md, "Standing alone").

    make test-alone                                    # every module under tests/ and e2e/
    .venv/bin/python tests/alone.py --jobs 1 --seed 7 tests/stage_operator
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stress import ROOT, run_module


def modules(paths: list[str]) -> list[str]:
    found = []
    for path in paths:
        target = ROOT / path
        files = [target] if target.is_file() else sorted(target.rglob('test_*.py'))
        found += [str(f.relative_to(ROOT)) for f in files if '.venv' not in f.parts]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('paths', nargs='*', default=['tests', 'e2e'])
    parser.add_argument('--jobs', type=int, default=2)
    parser.add_argument('--seed', type=int, default=None, help='the shuffling seed (default: random)')
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1, 10 ** 6)
    todo = modules(args.paths)
    print(f'alone: {len(todo)} modules, {args.jobs} at a time, seed {seed}', flush=True)
    started, failed = time.monotonic(), []

    def one(module: str) -> None:
        outcomes, took, tail = run_module(module, seed)
        bad = sorted(t.split('::', 1)[1] for t, o in outcomes.items() if o == 'failed')
        print(f"  {'FAIL' if bad else 'ok  '} {module}: {len(outcomes) - len(bad)}/{len(outcomes)} in {took:.0f} s",
              flush=True)
        if bad:
            failed.append(module)
            print('    failed: ' + ', '.join(bad) + '\n' + '\n'.join('    | ' + line for line in tail.splitlines()[-25:]),
                  flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, todo))
    print(f'\n{len(todo) - len(failed)}/{len(todo)} modules passed alone (seed {seed}) in '
          f'{time.monotonic() - started:.0f} s' + (f'; failed: {", ".join(failed)}' if failed else ''))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
