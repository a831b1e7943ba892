"""``POST /v1/videos`` video-to-video (Wan VACE) through one real stage process serving tiny-wan-vace with a job
store: a real MP4 upload (``input_video``), a mask video (``mask_video``) and a reference picture (``reference_image``)
as multipart parts; the job's exact frames equal WanVACEPipeline's own call on the decoded uploads; an upload over a
bound or one the model cannot condition on is a 400 naming the part and its value, before anything is stored."""

from __future__ import annotations

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


def test_an_uploaded_video_mask_and_reference_make_the_bare_pipelines_video(stage, tiny_wan_vace_path):
    clip = source_video(16, 9)
    files = [("input_video", ("source.mp4", encode_mp4(clip.frames, 8), "video/mp4")),
             ("mask_video", ("mask.mp4", encode_mp4(clip.mask, 8), "video/mp4")),
             ("reference_image", ("ref.png", encode_png(clip.references[0]), "image/png"))]
    answer = create(stage, files)
    assert answer.status_code == 200, answer.text
    job = answer.json()
    assert (job["size"], job["diffstage"]["num_frames"]) == ("16x16", 9)       # both from the video
    url = f"{stage[0].http_url}/v1/videos/{job['id']}"
    wait_until(lambda: httpx.get(url).json()["status"] in ("completed", "failed"), timeout=120)
    assert httpx.get(url).json()["status"] == "completed", httpx.get(url).text
    frames = zip_frames(httpx.get(f"{url}/content", params={"variant": "frames"}).content)
    uploaded = type(clip)(decode_mp4(files[0][1][1])[0], decode_mp4(files[1][1][1])[0], clip.references)
    row = Family("wan-vace", size=16, frames=9, one_generator=True, per_video=True,
                 call=lambda pipe, prompt, n, g: {"prompt": prompt, "guidance_scale": g})
    expected = bare_call(row, tiny_wan_vace_path, "a red fox", 3, 5, 5.0, **video_keywords(uploaded))[0]
    assert frames.shape == (9, 16, 16, 3) and int(np.abs(frames.astype(int) - expected).max()) <= 2


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
