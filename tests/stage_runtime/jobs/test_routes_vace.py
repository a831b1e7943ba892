"""``POST /v1/videos`` video-to-video (Wan VACE) through one real stage process serving tiny-wan-vace with a job
store: a real MP4 upload (``input_video``), a mask video (``mask_video``) and a reference picture (``reference_image``)
as multipart parts; the job's exact frames equal WanVACEPipeline's own call on the decoded uploads; an upload over a
bound or one the model cannot condition on is a 400 naming the part and its value, before anything is stored. The same
inputs as base64 in a JSON body make the same video on /v1/videos/sync and /v1/videos."""

from __future__ import annotations

import base64
import os

import httpx
import numpy as np
import pytest
from family_checks import Family, bare_call, source_video, video_keywords
from job_replicas import zip_frames
from stage_process import StageProcess
from support.waiting import wait_until

from stage_runtime.imageio import encode_png
from stage_runtime.videoio import MAX_UPLOAD_BYTES, decode_mp4, encode_mp4

CONFIG = "warmup: false\njobs:\n  poll_after_ms: 20\n  scan_interval_s: 0.2\n"
FIELDS = {"num_inference_steps": "3", "seed": "5", "guidance_scale": "5.0", "fps": "8"}


@pytest.fixture(scope="module")
def stage(tiny_wan_vace_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vace-stage")
    (folder / "stage.yaml").write_text(CONFIG)
    process = StageProcess(["--model", tiny_wan_vace_path, "--served-name", "tiny-wan-vace", "--config",
                            str(folder / "stage.yaml"), "--device", "cpu", "--execution-mode", "step",
                            "--job-store", str(folder / "store")], folder / "stage.log")
    try:
        process.start()
        yield process, folder / "store"
        assert process.stop() == 0, process.log[-3000:]
    finally:
        process.kill()


def create(stage, files: dict, **fields) -> httpx.Response:
    process, _ = stage
    return httpx.post(f"{process.http_url}/v1/videos", data={"prompt": "a red fox", **FIELDS, **fields},
                      files=files, timeout=60)


@pytest.fixture(scope="module")
def uploads(tiny_wan_vace_path) -> tuple[dict[str, bytes], np.ndarray]:
    """The uploads (a source MP4, a mask MP4, a reference PNG) and the bare WanVACEPipeline call's frames on them as
    the stage decodes them."""
    clip = source_video(16, 9)
    files = {"input_video": encode_mp4(clip.frames, 8), "mask_video": encode_mp4(clip.mask, 8),
             "reference_image": encode_png(clip.references[0])}
    uploaded = type(clip)(decode_mp4(files["input_video"])[0], decode_mp4(files["mask_video"])[0], clip.references)
    row = Family("wan-vace", size=16, frames=9, one_generator=True, per_video=True,
                 call=lambda pipe, prompt, n, g: {"prompt": prompt, "guidance_scale": g})
    return files, bare_call(row, tiny_wan_vace_path, "a red fox", 3, 5, 5.0, **video_keywords(uploaded))[0]


def completed_frames(stage, job: dict) -> np.ndarray:
    url = f"{stage[0].http_url}/v1/videos/{job['id']}"
    wait_until(lambda: httpx.get(url).json()["status"] in ("completed", "failed"), timeout=120)
    assert httpx.get(url).json()["status"] == "completed", httpx.get(url).text
    return zip_frames(httpx.get(f"{url}/content", params={"variant": "frames"}).content)


def test_an_uploaded_video_mask_and_reference_make_the_bare_pipelines_video(stage, uploads):
    files, expected = uploads
    parts = [("input_video", ("source.mp4", files["input_video"], "video/mp4")),
             ("mask_video", ("mask.mp4", files["mask_video"], "video/mp4")),
             ("reference_image", ("ref.png", files["reference_image"], "image/png"))]
    answer = create(stage, parts)
    assert answer.status_code == 200, answer.text
    job = answer.json()
    assert (job["size"], job["diffstage"]["num_frames"]) == ("16x16", 9)       # both from the video
    frames = completed_frames(stage, job)
    assert frames.shape == (9, 16, 16, 3) and int(np.abs(frames.astype(int) - expected).max()) <= 2


def json_body(files: dict[str, bytes], **more) -> dict:
    """The same request as JSON: the videos and the picture base64 (the picture as a data: URL)."""
    b64 = {name: base64.b64encode(data).decode() for name, data in files.items()}
    return {"prompt": "a red fox", "num_inference_steps": 3, "seed": 5, "guidance_scale": 5.0, "fps": 8,
            "input_video": b64["input_video"], "mask_video": b64["mask_video"],
            "reference_image": [f"data:image/png;base64,{b64['reference_image']}"], **more}


def test_the_same_inputs_as_base64_json_make_the_same_video_on_the_sync_and_the_job_route(stage, uploads):
    files, expected = uploads
    url = stage[0].http_url
    sync = httpx.post(f"{url}/v1/videos/sync", json=json_body(files, response_format="frames"), timeout=120)
    assert sync.status_code == 200, sync.text
    assert int(np.abs(zip_frames(sync.content).astype(int) - expected).max()) <= 2
    created = httpx.post(f"{url}/v1/videos", json=json_body(files), timeout=60)
    assert created.status_code == 200, created.text
    assert created.json()["size"] == "16x16"
    assert int(np.abs(completed_frames(stage, created.json()).astype(int) - expected).max()) <= 2


@pytest.mark.parametrize("route", ["/v1/videos/sync", "/v1/videos"])
@pytest.mark.parametrize(("change", "param", "message"), [
    ({"input_video": "not base64!"}, "input_video", "must be a base64 video"),
    ({"mask_video": base64.b64encode(b"not a video").decode()}, "mask_video", "not a decodable video"),
    ({"reference_image": ["x"] * 9}, "reference_image[8]", "at most 8 reference images"),
])
def test_a_json_upload_that_is_not_usable_is_a_400_naming_it_and_nothing_is_stored(stage, uploads, route, change,
                                                                                   param, message):
    store = stage[1] / "jobs"
    before = set(os.listdir(store)) if store.is_dir() else set()
    answer = httpx.post(f"{stage[0].http_url}{route}", json={**json_body(uploads[0]), **change}, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param and message in error["message"], answer.text
    assert (set(os.listdir(store)) if store.is_dir() else set()) == before


def _mp4(frames: int) -> bytes:
    return encode_mp4(source_video(16, frames).frames, 8)


@pytest.mark.parametrize(("files", "param", "message"), [
    ({"input_video": ("v.mp4", b"\0" * (MAX_UPLOAD_BYTES + 1), "video/mp4")}, "input_video",
     f"input_video='<{MAX_UPLOAD_BYTES + 1} bytes>': an uploaded video is at most {MAX_UPLOAD_BYTES} bytes"),
    ({"input_video": ("v.mp4", b"not a video", "video/mp4")}, "input_video", "not a decodable video"),
    ({"input_video": ("v.mp4", _mp4(8), "video/mp4")}, "input_video",
     "input_video='8 frames': WanVACEPipeline takes 4k+1 frames"),
    ({"input_video": ("v.mp4", _mp4(9), "video/mp4"), "mask_video": ("m.mp4", _mp4(5), "video/mp4")}, "mask_video",
     "mask_video='5 frames': must have input_video's 9 frames"),
    ({"mask_video": ("m.mp4", _mp4(9), "video/mp4")}, "mask_video", "a mask video needs the input_video"),
])
def test_an_upload_over_a_bound_or_unusable_is_a_400_naming_it_and_nothing_is_stored(stage, files, param, message):
    store = stage[1] / "jobs"
    before = set(os.listdir(store)) if store.is_dir() else set()
    answer = create(stage, files)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param and message in error["message"], answer.text
    assert (set(os.listdir(store)) if store.is_dir() else set()) == before
