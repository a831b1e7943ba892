"""Rules that keep the suite independent of the machine's speed and of the order of its tests (docs/testing.md,
"The rules"), checked by reading the test tree (``ast``): each rule has a case showing it fails.

- No test reads ``/proc/<pid>`` itself: the one reader per tree (``stage_runtime/process_tree.py`` ``proc_stat``
  for the tests and the GPU check, ``e2e/local/pod_process.py`` ``proc_stat``) treats a process that vanishes
  between the open and the read (ESRCH, ProcessLookupError) as gone.
- No ``sleep`` in a test module: a test waits on a named condition (``wait_until(..., what=...)``,
  ``scenario.wait_for``). ``sleep(0)`` (a yield to the event loop) is no wait; the exceptions below say why each
  is not evidence.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROC_READERS = {'e2e/local/pod_process.py', 'tests/test_suite_rules.py'}
PROC_PID = re.compile(r"""/proc/\{""")  # an f-string path with a pid in it
SLEEPS_ALLOWED = {
    # (module, line text) → why it is not evidence
    ('tests/stage_runtime/fetch/test_cache.py', 'time.sleep(0.2)'):
        'holds the lock open so that a second fetcher, if it were let in, would overlap and show in the order',
    ('tests/stage_runtime/serve/test_startup.py', 'time.sleep(0.1)'):
        'the poll interval of a loop that samples the phases the stage reports until it exits (the exit is waited)',
}


def python_files() -> list[Path]:
    return sorted(p for d in ('tests', 'e2e') for p in (ROOT / d).rglob('*.py'))


def proc_readers(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1) if PROC_PID.search(line) and not line.lstrip().startswith('#')]


def sleeps(text: str) -> list[tuple[int, str]]:
    """Calls of ``sleep``/``time.sleep``/``asyncio.sleep`` with a non-zero argument (code, not strings)."""
    found = []
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, 'id', '')
            zero = node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0
            if name == 'sleep' and not zero:
                found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_no_test_reads_proc_but_the_two_readers_that_treat_a_vanished_process_as_gone():
    offenders = {str(p.relative_to(ROOT)): lines for p in python_files()
                 if str(p.relative_to(ROOT)) not in PROC_READERS and (lines := proc_readers(p.read_text()))}
    assert not offenders, f'read /proc/<pid> through proc_stat (stage_runtime/process_tree.py, pod_process.py): {offenders}'


def test_no_test_module_sleeps_as_evidence():
    offenders = {}
    for path in python_files():
        rel = str(path.relative_to(ROOT))
        if path.name.startswith('test_'):
            bad = [(n, line) for n, line in sleeps(path.read_text())
                   if not any((rel, allowed) == key and allowed in line for key in SLEEPS_ALLOWED
                              for allowed in [key[1]])]
            if bad:
                offenders[rel] = bad
    assert not offenders, f'wait on a named condition instead (support/waiting.py, scenario.wait_for): {offenders}'


def test_every_allowed_sleep_still_exists():
    for (module, line), _ in SLEEPS_ALLOWED.items():
        assert line in (ROOT / module).read_text(), f'{module} no longer has {line}: drop it from SLEEPS_ALLOWED'


@pytest.mark.parametrize('source,count', [
    ("import time\ntime.sleep(1)  # kubectl is watching by now\n", 1),
    ("import asyncio\nasync def f():\n    await asyncio.sleep(0.5)\n", 1),
    ("import asyncio\nasync def f():\n    await asyncio.sleep(0)\n", 0),
    ("SCRIPT = 'import time\\ntime.sleep(600)'\n", 0),
])
def test_the_sleep_rule_finds_a_sleep_in_code_and_not_in_a_string(source, count):
    assert len(sleeps(source)) == count


def test_the_proc_rule_finds_a_pid_read():
    assert proc_readers("with open(f'/proc/{pid}/stat') as f:\n    pass\n") == [1]
    assert proc_readers("open('/proc/self/maps')\n") == []


def requesting(text: str, fixture: str) -> bool:
    """Whether a module has a test or fixture function that takes ``fixture`` as an argument."""
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and fixture in [a.arg for a in node.args.args]
               for node in ast.walk(ast.parse(text)))


def test_the_modules_of_a_shared_session_fixture_run_on_one_worker():
    """tests/conftest.py ONE_WORKER lists, per costly session fixture, exactly the modules that request it: they go to
    one xdist worker together, so the fixture is built once in a run."""
    from conftest import ONE_WORKER

    for fixture, modules in ONE_WORKER.items():
        users = {str(p.relative_to(ROOT)) for p in python_files()
                 if p.name.startswith('test_') and requesting(p.read_text(), fixture)}
        assert users == set(modules), f'{fixture}: tests/conftest.py ONE_WORKER should list exactly {sorted(users)}'


def test_the_fixture_rule_finds_a_request():
    assert requesting('def test_a(two_rank_runs):\n    pass\n', 'two_rank_runs')
    assert requesting('async def outcome(x, two_rank_runs):\n    pass\n', 'two_rank_runs')
    assert not requesting('def test_a(runs):\n    two_rank_runs = 1\n', 'two_rank_runs')
