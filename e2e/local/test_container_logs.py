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
    lines = read_lines(path)
    assert [(line.stream, line.partial) for line in lines] == [
        ('stdout', False), ('stderr', False), ('stdout', True), ('stdout', False), ('stdout', False)]
    assert lines[2].text == b'x' * LINE_LIMIT and lines[3].text == b'y', 'a long line: P records, then F'
    out = render([line for line in lines if line.stream == 'stdout']).decode()
    assert out == 'first\n' + 'x' * LINE_LIMIT + 'y\nno newline at the end\n'
    first = path.read_bytes().split(b'\n', 1)[0].decode()
    assert first.endswith(' stdout F first') and first[:30] == lines[0].time
    assert render(lines[:1], timestamps=True).decode() == f'{lines[0].time} first\n'


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
