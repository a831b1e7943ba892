"""A job's record as the OpenAI ``Video`` object: progress from the phase and step, seconds from frames and fps,
time-ordered ids."""

from __future__ import annotations

import pytest

from stage_runtime.jobs.record import JOB_ID, MAX_RUNS, JobRecord, new_job_id, progress_of, seconds_of


@pytest.mark.parametrize(("phase", "step", "num_steps", "progress"), [
    (None, 0, 30, 0), ("encode", 0, 30, 0), ("denoise", 1, 30, 3), ("denoise", 15, 30, 45), ("denoise", 29, 30, 87),
    ("decode", 30, 30, 90), ("mux", 30, 30, 95), ("denoise", 1, 3, 30), ("denoise", 2, 3, 60)])
def test_progress_is_the_denoising_steps_done_then_decode_then_mux(phase, step, num_steps, progress):
    assert progress_of(phase, step, num_steps) == progress


def test_seconds_are_the_intervals_between_frames():
    assert (seconds_of(81, 16), seconds_of(9, 8), seconds_of(9, 16), seconds_of(1, 24)) == ("5", "1", "0.5", "0")


def test_ids_sort_in_creation_order_and_match_the_id_rule():
    ids = [new_job_id(1_700_000_000.0 + k * 0.001) for k in range(50)]
    assert ids == sorted(ids) and all(JOB_ID.match(i) for i in ids) and len(set(ids)) == 50


def test_the_video_object_has_the_openai_fields_and_what_this_stage_adds():
    record = JobRecord(id=new_job_id(1000.5), model="tiny-wan", prompt="a fox", size="16x16", num_frames=9, fps=8,
                       num_steps=3, params={"prompt": "a fox", "seed": 7}, created_at=1000.5, status="completed",
                       progress=100, completed_at=1002.9, expires_at=2002.9, owner=None, attempts=1)
    video = record.video()
    assert {k: video[k] for k in ("object", "status", "progress", "created_at", "completed_at", "expires_at",
                                  "seconds", "size", "model", "error")} == {
        "object": "video", "status": "completed", "progress": 100, "created_at": 1000, "completed_at": 1002,
        "expires_at": 2002, "seconds": "1", "size": "16x16", "model": "tiny-wan", "error": None}
    assert video["diffstage"] == {"phase": None, "step": 0, "num_steps": 3, "num_frames": 9, "fps": 8, "seed": 7,
                                  "owner": None, "attempts": 1, "handoffs": 0, "requeued_because": None,
                                  "checkpoint_step": None, "resumed_from_step": None, "decode_retries": 0, "runs": []}
    given = record.model_copy(update={"params": {"seconds": 4}})
    assert given.video()["seconds"] == "4"


def record(**fields) -> JobRecord:
    return JobRecord(id=new_job_id(1000.0), model="tiny-wan", prompt="a fox", size="16x16", num_frames=9, fps=8,
                     num_steps=30, params={}, created_at=1000.0, **fields)


def test_the_run_history_closes_a_vanished_owners_run_at_its_last_reported_step():
    first = record(step=0)
    first = first.model_copy(update={"runs": first.with_run_started("pod-a-1", 0, 1001.0), "step": 12})
    second = first.model_copy(update={"runs": first.with_run_started("pod-b-1", 10, 1040.0)})
    assert [(r.owner, r.from_step, r.to_step, r.outcome, r.ended_at) for r in second.runs] == [
        ("pod-a-1", 0, 12, "lease_expired", 1040.0), ("pod-b-1", 10, None, None, None)]
    done = second.with_run_ended("completed", 30, 1050.0)
    assert (done[-1].outcome, done[-1].to_step, done[-1].ended_at) == ("completed", 30, 1050.0)
    assert second.model_copy(update={"runs": done}).with_run_ended("failed", 1, 1060.0) == done   # closed: as is


def test_a_vanished_owners_run_ends_at_its_newest_checkpoint_when_the_progress_write_lagged_it():
    """Regression (a clean-clone run): the owner checkpointed step 10, its progress write still said 8 when it was
    killed; the next run resumed from 10, so the lost run reached 10."""
    first = record(step=0)
    first = first.model_copy(update={"runs": first.with_run_started("pod-a-1", 0, 1001.0), "step": 8,
                                     "checkpoint_step": 10})
    second = first.with_run_started("pod-b-1", 10, 1040.0)
    assert (second[0].to_step, second[1].from_step) == (10, 10)
    assert record(step=12, checkpoint_step=10).reached_step == 12


def test_the_history_keeps_the_newest_runs_and_hand_offs_are_no_failed_attempts():
    many = record()
    for k in range(MAX_RUNS + 5):
        many = many.model_copy(update={"runs": many.with_run_started(f"pod-{k}", k, 1000.0 + k)})
    assert len(many.runs) == MAX_RUNS and many.runs[-1].owner == f"pod-{MAX_RUNS + 4}"
    assert record(attempts=4, handoffs=3).failed_attempts == 1


def test_a_record_written_by_a_newer_replica_is_read_with_its_unknown_fields_ignored():
    """A rolling upgrade: the old replicas still read (and run) the jobs the new ones wrote."""
    newer = {**record().model_dump(mode="json"), "priority": "high", "error": None,
             "runs": [{"owner": "pod-a-1", "started_at": 1001.0, "gpu": "H200"}]}
    read = JobRecord.model_validate(newer)
    assert read.id == newer["id"] and read.runs[0].owner == "pod-a-1" and not hasattr(read, "priority")
