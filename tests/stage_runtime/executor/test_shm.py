"""Shared-memory packing: round trips, the inline threshold, unlink-on-read, no mutation, sweep."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from stage_runtime.executor import shm
from stage_runtime.outputs import BatchRunnerOutput, RunnerOutput


@pytest.fixture
def writer():
    prefix = f"ds-test-{os.getpid()}-"
    yield shm.ShmWriter(prefix, rank=1)
    assert shm.sweep(prefix) == [], "a test left a segment behind"


def segments(prefix: str) -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.glob(f"{prefix}*"))


def test_small_arrays_stay_inline_and_the_boundary_is_inclusive(writer):
    at_threshold = np.zeros(shm.SHM_THRESHOLD, np.uint8)
    assert writer.put(at_threshold) is at_threshold
    assert isinstance(writer.put(np.zeros(shm.SHM_THRESHOLD + 1, np.uint8)), shm.ShmArray)
    shm.sweep(writer.prefix)


def test_large_array_round_trip_keeps_dtype_and_shape_and_unlinks_on_read(writer):
    array = np.random.default_rng(0).integers(0, 255, (2, 512, 512, 3), dtype=np.uint8)
    handle = writer.put(array)
    assert isinstance(handle, shm.ShmArray) and handle.shape == array.shape
    assert segments(writer.prefix) == [handle.name]
    handle = pickle.loads(pickle.dumps(handle))          # it travels inline in a message
    back = shm.read(handle)
    assert segments(writer.prefix) == []                 # unlinked before the data is even used
    np.testing.assert_array_equal(back, array)
    assert back.dtype == np.uint8


def test_float_arrays_and_nested_containers(writer):
    big = np.arange(300_000, dtype=np.float32).reshape(3, 100_000)
    obj = {"a": [big, 1, "x"], "b": (np.ones(3), big[1:])}
    packed = writer.pack(obj)
    assert obj["a"][0] is big, "packing must not mutate its input"
    assert isinstance(packed["a"][0], shm.ShmArray) and isinstance(packed["b"][0], np.ndarray)
    back = shm.unpack(pickle.loads(pickle.dumps(packed)))
    np.testing.assert_array_equal(back["a"][0], big)
    np.testing.assert_array_equal(back["b"][1], big[1:])
    assert back["a"][1:] == [1, "x"]


def test_runner_outputs_pack_images_only(writer):
    images = np.full((2, 512, 512, 3), 7, np.uint8)                    # 1.5 MB
    batch = BatchRunnerOutput.of(RunnerOutput("big", images=images, step_index=4),
                                 RunnerOutput("small", images=images[:, :8, :8]),
                                 RunnerOutput("failed", error="boom"))
    packed = writer.pack(batch)
    assert isinstance(packed.get("big").images, shm.ShmArray)
    assert isinstance(packed.get("small").images, np.ndarray)
    assert batch.get("big").images is images
    back = shm.unpack(packed)
    np.testing.assert_array_equal(back.get("big").images, images)
    assert back.get("big").step_index == 4 and back.get("failed").error == "boom"
    assert segments(writer.prefix) == []


def test_sweep_removes_what_a_crash_left(writer):
    handles = [writer.put(np.zeros(shm.SHM_THRESHOLD * 2, np.uint8)) for _ in range(3)]
    assert len(segments(writer.prefix)) == 3
    assert sorted(shm.sweep(writer.prefix)) == sorted(h.name for h in handles)
    assert segments(writer.prefix) == []


def test_object_arrays_never_go_to_shared_memory(writer):
    objects = np.array([object()] * (shm.SHM_THRESHOLD // 4), dtype=object)
    assert writer.put(objects) is objects
