"""``/v1/videos`` as the official ``openai`` SDK calls it, against two real stage processes serving the tiny Wan that
share one job store (two replicas of a stage: A runs the multiprocess executor, B the in-process one): a job made
on one is polled, listed, downloaded and deleted on either; its exact frames equal the bare diffusers call; its
progress is its steps; a DELETE stops a running job within one step wherever it runs; an expired job is a 404 at
once and its files go with its record; a bad field is a 400 naming it and stores nothing."""

from __future__ import annotations

import io
import os
import time

import httpx
import numpy as np
import openai
import pytest
from family_checks import Family, bare_call, reference_image
from PIL import Image
from job_replicas import owner_of, replicas, sdk, zip_frames
from stage_process import StageProcess
from support.waiting import wait_until

from stage_runtime.imageio import encode_png
from stage_runtime.jobs.record import progress_of
from stage_runtime.jobs.store.filesystem import FileJobStore
from stage_runtime.videoio import decode_mp4, encode_mp4

WAN = Family("wan", size=16, frames=9)
FIELDS = {"num_frames": 9, "num_inference_steps": 3, "seed": 5, "guidance_scale": 6.0, "fps": 8}
LONG = {"num_frames": 9, "num_inference_steps": 999}      # runs until deleted (~20 ms a step)
CONFIG = "warmup: false\njobs:\n  poll_after_ms: 20\n  scan_interval_s: 0.2\n  lease_s: 6\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("job-store")


@pytest.fixture(scope="module")
def stages(tiny_wan_path, tmp_path_factory, store):
    with replicas(tiny_wan_path, tmp_path_factory.mktemp("replicas"), ["--job-store", str(store)], CONFIG) as pair:
        yield pair


@pytest.fixture(scope="module")
def clients(stages):
    a, b = sdk(stages[0]), sdk(stages[1])
    yield a, b
    a.close()
    b.close()


def job_folders(store) -> set[str]:
    return set(os.listdir(store / "jobs"))


def test_create_and_poll_then_each_replica_answers_and_downloads_the_same_job(clients, tiny_wan_path):
    a, b = clients
    video = a.videos.create_and_poll(prompt="a red fox", size="16x16", extra_body=FIELDS)
    assert (video.status, video.progress, video.size, video.seconds, video.model) == (
        "completed", 100, "16x16", "1", "tiny-wan"), video
    assert video.error is None and video.created_at <= video.completed_at < video.expires_at
    assert video.diffstage["step"] == 3 and video.diffstage["seed"] == 5 and video.diffstage["attempts"] == 1
    assert b.videos.retrieve(video.id) == video                       # the other replica: the same record
    mp4, fps = decode_mp4(a.videos.download_content(video.id).read())
    frames = zip_frames(b.videos.download_content(video.id, variant="frames").read())
    thumbnail = np.asarray(Image.open(io.BytesIO(b.videos.download_content(video.id, variant="thumbnail").read())))
    assert mp4.shape == (9, 16, 16, 3) and fps == 8 and frames.shape == (9, 16, 16, 3)
    reference = bare_call(WAN, tiny_wan_path, "a red fox", 3, 5, 6.0)[0]
    assert int(np.abs(frames.astype(int) - reference).max()) <= 2
    assert np.array_equal(thumbnail, frames[0])
    with pytest.raises(openai.BadRequestError) as spritesheet:
        a.videos.download_content(video.id, variant="spritesheet")
    assert spritesheet.value.body["param"] == "variant"
    with pytest.raises(openai.BadRequestError) as silent:           # Wan makes no sound: no WAV, and no AAC in the MP4
        a.videos.download_content(video.id, variant="audio")
    assert silent.value.body["param"] == "variant" and "has no audio track" in silent.value.body["message"]


def test_content_answers_one_byte_range_as_a_player_seeks(clients, stages):
    """A player seeking in the MP4 asks for a byte range: 206 with Content-Range and those bytes; a range past the end
    is a 416 naming the size; every answer says Accept-Ranges."""
    a, _ = clients
    video = a.videos.create_and_poll(prompt="a seeking fox", size="16x16", extra_body={**FIELDS, "num_inference_steps": 1})
    url = f"{stages[1].http_url}/v1/videos/{video.id}/content"
    whole = httpx.get(url)
    size = len(whole.content)
    assert whole.status_code == 200 and whole.headers["Accept-Ranges"] == "bytes" and size > 100
    part = httpx.get(url, headers={"Range": "bytes=10-49"})
    assert part.status_code == 206 and part.content == whole.content[10:50], part.headers
    assert part.headers["Content-Range"] == f"bytes 10-49/{size}" and part.headers["Content-Type"] == "video/mp4"
    tail = httpx.get(url, headers={"Range": "bytes=-16"})
    assert tail.status_code == 206 and tail.content == whole.content[-16:]
    past = httpx.get(url, headers={"Range": f"bytes={size}-"})
    assert past.status_code == 416 and past.headers["Content-Range"] == f"bytes */{size}"


def watch(client: openai.OpenAI, video_id: str, min_step: int) -> list:
    """Retrieve until the job's record says ``min_step`` steps; every answer on the way."""
    seen = []

    def reached() -> bool:
        seen.append(client.videos.retrieve(video_id))
        return seen[-1].diffstage["step"] >= min_step

    wait_until(reached, timeout=60, what=f"{video_id} at step {min_step}", poll=0.01)
    return seen


def assert_progress_is_the_steps(seen: list) -> None:
    steps = [v.diffstage["step"] for v in seen]
    assert steps == sorted(steps) and [v.progress for v in seen] == sorted(v.progress for v in seen)
    for v in seen:
        assert v.progress == progress_of(v.diffstage["phase"], v.diffstage["step"], v.diffstage["num_steps"]), v
        assert v.status == "in_progress" or (v.status, v.diffstage["phase"], v.diffstage["step"]) == ("queued", None, 0)
    statuses = [v.status for v in seen]
    assert statuses == sorted(statuses, key=("queued", "in_progress").index), statuses     # queued, then in progress


def test_delete_of_a_running_job_stops_it_within_one_step_where_it_runs(clients, stages, store):
    a, b = clients
    video = a.videos.create(prompt="a long fox", size="16x16", extra_body=LONG)
    seen = watch(b, video.id, 3)
    assert_progress_is_the_steps(seen)
    owner = owner_of(stages, seen[-1])
    deleted = sdk(owner).videos.delete(video.id)
    assert deleted.deleted and deleted.object == "video.deleted" and deleted.diffstage["ran_here"]
    at, stopped = deleted.diffstage["step_at_delete"], deleted.diffstage["stopped_at_step"]
    assert seen[-1].diffstage["step"] <= at <= stopped <= at + 1 < 999, deleted.diffstage
    for client in clients:
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
    assert httpx.get(f"{owner.http_url}/v1/requests").json()["requests"] == []     # the engine holds nothing
    assert video.id not in job_folders(store) and os.listdir(store / "trash") == []


def test_delete_on_the_other_replica_stops_the_run_at_its_next_step(clients, stages, store):
    a, _ = clients
    video = a.videos.create(prompt="a long fox", size="16x16", extra_body=LONG)
    owner = owner_of(stages, watch(a, video.id, 2)[-1])
    other = next(stage for stage in stages if stage is not owner)
    aborted = httpx.get(f"{owner.http_url}/v1/stats").json()["aborted_total"]
    deleted = sdk(other).videos.delete(video.id)
    assert deleted.deleted and not deleted.diffstage["ran_here"] and deleted.diffstage["status"] == "in_progress"
    wait_until(lambda: httpx.get(f"{owner.http_url}/v1/requests").json()["requests"] == [], timeout=30,
               what="the owner's run stopped")
    stats = httpx.get(f"{owner.http_url}/v1/stats").json()
    assert stats["aborted_total"] == aborted + 1 and stats["running"] == 0
    assert video.id not in job_folders(store)


def test_stats_and_metrics_count_the_jobs_in_the_store_and_the_runs_here(clients, stages):
    """What the operator reads: ``jobs`` in /v1/stats (every replica counts the same store; ``here`` is the runs
    that would hand off if this replica drained) and the same figures on /metrics."""
    a, _ = clients
    video = a.videos.create(prompt="a counted fox", size="16x16", extra_body=LONG)
    owner = owner_of(stages, watch(a, video.id, 1)[-1])
    try:
        for stage in stages:
            jobs = wait_until(lambda: (j := httpx.get(f"{stage.http_url}/v1/stats").json()["jobs"])["in_progress"]
                              == 1 and j, timeout=30, what="the running job counted at a scan")
            assert jobs["here"] == (1 if stage is owner else 0) and jobs["queued"] == 0, jobs
        scraped = httpx.get(f"{owner.http_url}/metrics").text
        assert 'diffstage_video_jobs{status="in_progress"} 1.0' in scraped
        assert "diffstage_video_jobs_running_here 1.0" in scraped
        assert "diffstage_jobs_queued 0.0" in scraped                # store-wide backlog: what workers scale by
    finally:
        a.videos.delete(video.id)


def test_list_pages_with_after_and_limit_in_both_orders(clients, stages):
    a, b = clients
    marker = f"video_{int(time.time() * 1000) - 1:012x}" + "0" * 20      # sorts before every job made below
    made = [a.videos.create(prompt=f"fox {i}", size="16x16", extra_body={**FIELDS, "num_inference_steps": 1}).id
            for i in range(2)]
    as_json = httpx.post(f"{stages[1].http_url}/v1/videos", json={"prompt": "fox 2", "size": "16x16", **FIELDS})
    assert as_json.status_code == 200 and as_json.headers["openai-poll-after-ms"] == "20", as_json.text
    made.append(as_json.json()["id"])
    first = b.videos.list(limit=2, order="asc", after=marker)
    assert [v.id for v in first.data] == made[:2] and first.has_more and first.last_id == made[1]
    assert [v.id for v in first.get_next_page().data] == made[2:]
    assert [v.id for v in b.videos.list(limit=2, order="asc", after=marker)] == made      # the SDK pages on
    newest = a.videos.list(limit=2)                                                    # desc by default
    assert [v.id for v in newest.data] == made[:0:-1] and newest.has_more
    assert [v.id for v in a.videos.list(limit=100, order="desc", after=made[2]).data][:2] == made[1::-1]
    for video_id in made:
        a.videos.poll(video_id)
    for query, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "../x"}, "after")):
        answer = httpx.get(f"{stages[0].http_url}/v1/videos", params=query)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_an_expired_job_is_a_404_at_once_and_its_files_go_with_its_record(clients, stages, store):
    a, b = clients
    video = a.videos.create_and_poll(prompt="a brief fox", size="16x16",
                                     extra_body={**FIELDS, "num_inference_steps": 1})
    assert video.status == "completed" and len(a.videos.download_content(video.id).read()) > 0
    shared = FileJobStore(store)                                   # the test is a third process on the store
    shared.put(shared.get(video.id).model_copy(update={"expires_at": time.time() - 1}))     # its time has come
    for client in clients:
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
        with pytest.raises(openai.NotFoundError):
            client.videos.download_content(video.id)
        assert video.id not in [v.id for v in client.videos.list(limit=100)]
    wait_until(lambda: video.id not in job_folders(store) and os.listdir(store / "trash") == [], timeout=30,
               what="the sweep removed the job's folder (renamed out of jobs/, then removed)")
    assert os.listdir(store / "incoming") == []


PNG = encode_png(reference_image(16))


@pytest.mark.parametrize(("fields", "files", "param", "message"), [
    ({"num_frames": 10}, {}, "num_frames", "WanPipeline takes 4k+1 frames (9, 13"),
    ({"size": "20x16"}, {}, "width", "must be a multiple of 16"),
    ({"fps": 0}, {}, "fps", "greater than or equal to 1"),
    ({"num_inference_steps": "many"}, {}, "num_inference_steps", "valid integer"),
    ({"guidance_scale_2": 3.0}, {}, "guidance_scale_2", "Wan 2.2"),
    ({"colour": "red"}, {}, "colour", "Extra inputs are not permitted"),
    ({"model": "sora-2"}, {}, "model", "this stage serves 'tiny-wan'"),
    ({"prompt": "a " * 900}, {}, "prompt", "max_sequence_length"),
    ({}, {"input_reference": ("ref.png", b"not an image", "image/png")}, "input_reference", "not a decodable image"),
    ({}, {"input_reference": ("ref.png", PNG, "image/png")}, "input_reference", "takes no reference image"),
])
def test_a_bad_field_is_a_400_at_create_naming_it_and_nothing_is_stored(clients, store, fields, files, param,
                                                                        message):
    a, _ = clients
    before = job_folders(store)
    body = {"num_frames": 9, "num_inference_steps": 2, **fields}
    prompt = body.pop("prompt", "a fox")
    with pytest.raises(openai.BadRequestError) as refused:
        a.videos.create(prompt=prompt, size=body.pop("size", "16x16"), model=body.pop("model", openai.omit),
                        input_reference=files.get("input_reference", openai.omit), extra_body=body)
    error = refused.value.body
    assert error["param"] == param and message in error["message"], error
    assert job_folders(store) == before


def test_a_source_video_to_a_family_without_video_input_is_a_400_naming_it(stages, store):
    """Video-to-video uploads (``input_video``) are Wan VACE's: tiny Wan refuses one before anything is stored."""
    before = job_folders(store)
    clip = np.zeros((9, 16, 16, 3), np.uint8)
    answer = httpx.post(f"{stages[0].http_url}/v1/videos", data={"prompt": "a fox", "num_inference_steps": "2"},
                        files={"input_video": ("v.mp4", encode_mp4(clip, 8), "video/mp4")}, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "input_video", answer.text
    assert "WanPipeline takes no source video" in error["message"] and job_folders(store) == before


def test_a_json_create_is_typed_strictly(stages, store):
    before = job_folders(store)
    answer = httpx.post(f"{stages[0].http_url}/v1/videos", json={"prompt": "a fox", "num_frames": "9"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "num_frames", answer.text
    assert job_folders(store) == before


def test_a_job_store_that_is_not_a_writable_folder_exits_2_naming_it(tiny_wan_path, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    stage = StageProcess(["--model", tiny_wan_path, "--job-store", str(tmp_path / "file" / "jobs")],
                         tmp_path / "stage.log", termination_log=tmp_path / "termination")
    stage.start(wait_ready=False)
    try:
        assert stage.wait(60) == 2
    finally:
        stage.kill()
    reason = (tmp_path / "termination").read_text()
    assert reason.startswith("ConfigError: --job-store: job store ") and "is not a writable folder" in reason, reason
