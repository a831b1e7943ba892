"""The job store tests' time and store: a hand-set clock, and a store on the test's own folder reading it."""

from __future__ import annotations

import pytest
from support.clocks import Clock

from stage_runtime.jobs.store.filesystem import FileJobStore


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path, clock) -> FileJobStore:
    return FileJobStore(tmp_path / "store", clock).open()
