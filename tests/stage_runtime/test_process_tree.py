"""The process-tree probe: a grandchild is a descendant while it lives and leaves ``alive`` once it exits; the
segment it maps is used by it and is its own among the new ones, and a segment nobody of the tree touched is not."""

from __future__ import annotations

import subprocess
import sys
import uuid
from multiprocessing import shared_memory

from support.waiting import wait_until

from stage_runtime.process_tree import alive, descendants, proc_stat, segments_of, shm_segments, shm_used_by

# a child that starts a grandchild; the grandchild maps a segment, says its name, then waits for stdin
GRANDCHILD = """
import sys
from multiprocessing import shared_memory
segment = shared_memory.SharedMemory(name=sys.argv[1], create=True, size=4096)
print(segment.name, flush=True)
sys.stdin.read()
segment.close()
segment.unlink()
"""
CHILD = f"""
import subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", {GRANDCHILD!r}, sys.argv[1]], stdin=subprocess.PIPE,
                              stdout=sys.stdout)
sys.stdin.read()
grandchild.stdin.close()
grandchild.wait()
"""


def test_a_tree_its_segments_and_what_is_left_once_it_exits():
    before = shm_segments()
    name = f"ptree-{uuid.uuid4().hex[:8]}"
    stranger = shared_memory.SharedMemory(name=f"stranger-{uuid.uuid4().hex[:8]}", create=True, size=4096)
    child = subprocess.Popen([sys.executable, "-c", CHILD, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip().lstrip("/") == name           # the grandchild mapped it
        seen = wait_until(lambda: (tree := descendants(child.pid)) and tree, timeout=30, what="the grandchild")
        [grandchild] = [pid for pid in seen if proc_stat(pid)[0] == child.pid]    # (and its resource tracker)
        assert grandchild in alive(seen) and sorted(seen) == alive(seen)
        used = shm_used_by([child.pid, *seen])
        assert name in used and stranger.name not in used
        assert segments_of(shm_segments() - before, used, [child.pid, *seen]) == {name}
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        stranger.close()
        stranger.unlink()
    wait_until(lambda: alive(seen) == [], timeout=30, what="the grandchild gone")
    assert name not in shm_segments() and proc_stat(child.pid) is None
