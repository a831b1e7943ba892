"""A container's log file as the local kubelet writes it (CRI records, a line at a time, from a real process's pipes)
and what `kubectl logs` gets back from it: the text, tail by lines, since a time, timestamps."""
from __future__ import annotations

import subprocess
import sys

from e2e.local.container_logs import (LINE_LIMIT, ContainerLogs, Line, container_id, parse, parse_time, read_lines,
                                      render, run_of, since, tail, timestamp)

SCRIPT = r'''
import sys
sys.stdout.write("first\n"); sys.stdout.flush()
sys.stderr.write("to stderr\n"); sys.stderr.flush()
sys.stdout.write("x" * LIMIT + "y\n")
sys.stdout.write("no newline at the end")
'''.replace('LIMIT', str(LINE_LIMIT))


def run_logged(logs: ContainerLogs, script: str):
    path = logs.path('default', 'p', 'uid-1', 'c', 0)
    writer = logs.writer(path)
    process = subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer.attach(process)
    assert process.wait(30) == 0
    return path, writer


def test_a_process_output_becomes_cri_records_and_comes_back_as_its_text(tmp_path):
    logs = ContainerLogs(tmp_path / 'logs')
    path, writer = run_logged(logs, SCRIPT)
    assert path == tmp_path / 'logs' / 'default_p_uid-1' / 'c' / '0.log'
    assert logs.is_open(path)
    assert writer.close(10) and not logs.is_open(path), 'complete once the pipes ended'
    lines = read_lines(path)  # two pipes, two pumps: the order within a stream is kept, not across them
    stdout, stderr = ([line for line in lines if line.stream == name] for name in ('stdout', 'stderr'))
    assert [line.partial for line in stdout] == [False, True, False, False] and len(lines) == 5
    assert stdout[1].text == b'x' * LINE_LIMIT and stdout[2].text == b'y', 'a long line: P records, then F'
    assert render(stdout).decode() == 'first\n' + 'x' * LINE_LIMIT + 'y\nno newline at the end\n'
    assert render(stderr) == b'to stderr\n'
    records = path.read_bytes().decode().splitlines()
    assert f'{stdout[0].time} stdout F first' in records and f'{stderr[0].time} stderr F to stderr' in records
    assert render(stdout[:1], timestamps=True).decode() == f'{stdout[0].time} first\n'


def test_tail_counts_whole_lines_and_since_keeps_the_later_ones():
    at = [timestamp(10**18 + i * 10**9) for i in range(4)]
    lines = [Line(at[0], 'stdout', False, b'a'), Line(at[1], 'stdout', True, b'b1'),
             Line(at[2], 'stdout', False, b'b2'), Line(at[3], 'stdout', False, b'c')]
    assert render(tail(lines, 2)) == b'b1b2\nc\n' and render(tail(lines, 1)) == b'c\n'
    assert tail(lines, 9) == lines and tail(lines, 0) == []
    assert render(since(lines, parse_time(at[2]))) == b'b2\nc\n'


def test_times_and_container_ids_read_back():
    assert parse_time('2026-05-01T12:00:00Z') == parse_time('2026-05-01T14:00:00+02:00')
    assert parse_time('2026-05-01T12:00:00.5Z') - parse_time('2026-05-01T12:00:00Z') == 0.5
    assert parse_time(timestamp(1_700_000_000_123_456_789)) == 1_700_000_000.123456789
    cid = container_id('uid-1', 'stage', 3)
    assert run_of(cid, 'uid-1', 'stage') == 3 and run_of(cid, 'uid-2', 'stage') is None
    assert run_of('containerd://abc', 'uid-1', 'stage') is None


def test_a_record_being_written_is_left_for_the_next_read():
    lines, used = parse(b'2026-05-01T12:00:00.000000000Z stdout F done\n2026-05-01T12:00:01.0')
    assert [line.text for line in lines] == [b'done'] and used == len(b'2026-05-01T12:00:00.000000000Z stdout F done\n')
