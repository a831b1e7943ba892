"""``POST /v1/videos/sync`` on a real stage process serving the tiny Wan: the exact frames (a zip of PNGs) equal the
bare diffusers call; the MP4 plays (F frames of H×W at the asked fps) within a stated PSNR of them; a frame count
off the family's rule is a 400 naming it; images and videos each ask the family that makes them; a request's LoRA
adapters equal diffusers' and its block-cache policy is applied and reported; a streamed video reports its phases;
the stage drains to exit 0 and leaves nothing behind. A stage serving the tiny LTX-2 makes image-to-video from
``input_reference`` and text-to-video without it, and its sound goes into the MP4 (AAC) and out as WAV."""

from __future__ import annotations

import base64
import contextlib
import io
import zipfile

import httpx
import numpy as np
import openai
import pytest
import torch
from engine_probes import phased
from family_checks import Family, bare_call, bare_pipeline, generators, reference_image
from lora_probes import bare_with_loras, write_adapter
from PIL import Image
from serve_probes import sse_events
from stage_process import StageProcess

from stage_runtime.imageio import encode_png
from stage_runtime.audioio import decode_audio
from stage_runtime.videoio import decode_mp4, psnr

torch.set_num_threads(1)
WAN = Family("wan", size=16, frames=9)
BODY = {"prompt": "a red fox", "size": "16x16", "num_frames": 9, "num_inference_steps": 3, "seed": 5,
        "guidance_scale": 6.0, "fps": 8}
REFERENCE_B64 = base64.b64encode(encode_png(reference_image(16))).decode()
MP4_PSNR_DB = 27.0       # crf 18 on 16x16 noise-like frames of the random tiny model (measured 30-33 dB)


@contextlib.contextmanager
def video_stage(model: str, folder, *extra: str, config_text: str = ""):
    """A stage process serving ``model`` in step mode; stopped on the way out (drained: exit 0, no leaks)."""
    config = folder / "stage.yaml"
    config.write_text("warmup: false\njobs: {poll_after_ms: 20}\n" + config_text)   # warmup: the default size
    stage = StageProcess(["--model", model, "--config", str(config), "--device", "cpu", "--executor", "uni",
                          "--execution-mode", "step", *extra], folder / "stage.log")
    stage.start()
    try:
        yield stage
    finally:
        code = stage.stop()
    assert code == 0, stage.log[-3000:]
    stage.assert_no_leaks()


@pytest.fixture(scope="module")
def wan_lora(tiny_wan_path, tmp_path_factory) -> str:
    """A random adapter on the Wan transformer's attention and feed-forward (peft + diffusers' save_lora_weights)."""
    return write_adapter(tiny_wan_path, tmp_path_factory.mktemp("wan-lora") / "fast", seed=1, text_encoder=False,
                         gain=1.0)


@pytest.fixture(scope="module")
def wan_stage(tiny_wan_path, wan_lora, tmp_path_factory):
    loras = f"loras:\n  - name: fast\n    path: {wan_lora}\n"
    with video_stage(tiny_wan_path, tmp_path_factory.mktemp("wan-stage"), config_text=loras) as stage:
        yield stage


def zip_frames(content: bytes) -> np.ndarray:
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        return np.stack([np.asarray(Image.open(io.BytesIO(archive.read(name))).convert("RGB"))
                         for name in archive.namelist()])


def test_the_exact_frames_equal_diffusers_and_the_mp4_plays_within_the_stated_psnr(wan_stage, tiny_wan_path):
    reference = bare_call(WAN, tiny_wan_path, "a red fox", 3, 5, 6.0)[0]
    with httpx.Client(base_url=wan_stage.http_url, timeout=120) as http:
        zipped = http.post("/v1/videos/sync", json={**BODY, "response_format": "frames"})
        mp4 = http.post("/v1/videos/sync", json=BODY)
    assert zipped.status_code == 200 and zipped.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(zipped.content)) as archive:
        assert archive.namelist() == [f"frame_{i:04d}.png" for i in range(9)]
    frames = zip_frames(zipped.content)
    assert frames.shape == (9, 16, 16, 3) and int(np.abs(frames.astype(int) - reference).max()) <= 2
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4", mp4.text[:300]
    assert (mp4.headers["x-video-frames"], mp4.headers["x-video-fps"]) == ("9", "8")
    decoded, fps = decode_mp4(mp4.content)
    assert decoded.shape == (9, 16, 16, 3) and fps == 8
    assert psnr(decoded, frames) >= MP4_PSNR_DB


def test_a_request_names_its_lora_adapters_and_its_block_cache_policy(wan_stage, tiny_wan_path, wan_lora):
    body = {**BODY, "response_format": "frames"}
    with httpx.Client(base_url=wan_stage.http_url, timeout=120) as http:
        plain, zero, huge, adapted = (http.post("/v1/videos/sync", json={**body, **extra}) for extra in (
            {}, {"cache": {"threshold": 0}}, {"cache": {"threshold": 10}}, {"loras": [{"name": "fast", "scale": 0.8}]}))
    assert all(answer.status_code == 200 for answer in (plain, zero, huge, adapted)), adapted.text[:300]
    assert np.array_equal(zip_frames(zero.content), zip_frames(plain.content))
    assert "x-cache-steps-computed" not in plain.headers
    cache = [(a.headers["x-cache-steps-computed"], a.headers["x-cache-steps-skipped"]) for a in (zero, huge)]
    assert cache == [("3", "0"), ("2", "1")]                 # 3 steps: warmup 1 and final 1 are computed
    lora = bare_with_loras(tiny_wan_path, {"fast": wan_lora}, [0.8], "a red fox", 3, 5, size=16, num_frames=9,
                           guidance_scale=6.0)[0]
    assert int(np.abs(zip_frames(adapted.content).astype(int) - lora).max()) <= 2        # step mode


@pytest.mark.parametrize(("path", "body", "field", "message"), [
    ("/v1/videos/sync", {**BODY, "num_frames": 10}, "num_frames", "WanPipeline takes 4k+1 frames (9, 13"),
    ("/v1/videos/sync", {**BODY, "size": "20x16"}, "width", "must be a multiple of 16"),
    ("/v1/videos/sync", {**BODY, "fps": 0}, "fps", "greater than or equal to 1"),
    ("/v1/images/generations", {"prompt": "a red fox", "size": "16x16"}, "model", "makes videos"),
    ("/v1/videos/sync", {**BODY, "input_reference": "not base64!"}, "input_reference", "must be a base64 image"),
    ("/v1/videos/sync", {**BODY, "input_reference": "é"}, "input_reference", "must be a base64 image"),
    ("/v1/videos/sync", {**BODY, "input_reference": REFERENCE_B64}, "input_reference", "takes no reference image"),
    ("/v1/videos/sync", {**BODY, "loras": [{"name": "nope", "scale": 1.0}]}, "loras.0.name", "nope"),
    ("/v1/videos/sync", {**BODY, "loras": [{"name": "fast", "scale": 1.0}] * 2}, "loras", "names an adapter twice"),
    ("/v1/videos/sync", {**BODY, "cache": {"threshold": -1}}, "cache", "must be \"off\" or {\"threshold\": x}"),
])
def test_a_bad_video_request_is_a_400_naming_the_field(wan_stage, path, body, field, message):
    with httpx.Client(base_url=wan_stage.http_url, timeout=60) as http:
        answer = http.post(path, json=body)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == field and message in error["message"], error


def test_seconds_without_num_frames_are_seconds_times_fps_plus_one_frames(wan_stage):
    with httpx.Client(base_url=wan_stage.http_url, timeout=120) as http:
        answer = http.post("/v1/videos/sync", json={**{k: v for k, v in BODY.items() if k != "num_frames"},
                                                   "seconds": 1, "fps": 4})
    assert answer.status_code == 200 and answer.headers["x-video-frames"] == "5", answer.text[:300]


def test_a_streamed_video_reports_each_phase_in_order_then_the_exact_frames(wan_stage, tiny_wan_path):
    with httpx.Client(base_url=wan_stage.http_url, timeout=120) as http:
        with http.stream("POST", "/v1/videos/sync", json={**BODY, "stream": True, "response_format": "frames",
                                                          "request_id": "streamed"}) as answer:
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
            events = sse_events(answer.read().decode())
    progress = [(d["phase"], d["step"]) for kind, d in events if kind == "video.progress"]
    assert progress == [*phased(3), ("mux", 3)]                   # encode, denoise 1..2, decode, mux
    assert [kind for kind, _ in events][-1] == "video.completed" and len(events) == len(progress) + 1
    done = events[-1][1]
    assert (done["id"], done["content_type"], done["frames"], done["fps"], done["size"]) == (
        "streamed", "application/zip", 9, 8, "16x16")
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(done["b64_json"]))) as archive:
        frames = np.stack([np.asarray(Image.open(io.BytesIO(archive.read(n))).convert("RGB"))
                           for n in archive.namelist()])
    reference = bare_call(WAN, tiny_wan_path, "a red fox", 3, 5, 6.0)[0]
    assert int(np.abs(frames.astype(int) - reference).max()) <= 2


def test_a_streamed_video_that_fails_ends_with_one_error_event(wan_stage):
    with httpx.Client(base_url=wan_stage.http_url, timeout=120) as http:
        with http.stream("POST", "/v1/videos/sync", json={**BODY, "stream": True, "timeout_s": 0.001}) as answer:
            events = sse_events(answer.read().decode())
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "deadline_exceeded", events
    assert [kind for kind, _ in events].count("video.completed") == 0


@pytest.fixture(scope="module")
def ltx2_stage(tiny_ltx2_path, tmp_path_factory):
    """A stage serving the tiny LTX-2 in step mode on a worker process, with a job store."""
    folder = tmp_path_factory.mktemp("ltx2-stage")
    with video_stage(tiny_ltx2_path, folder, "--job-store", str(folder / "jobs"), "--executor", "mp") as stage:
        yield stage


def test_ltx2_makes_image_to_video_from_input_reference_and_text_to_video_without(tiny_ltx2_path, ltx2_stage):
    """One LTX-2 stage: with ``input_reference`` the frames equal LTX2ImageToVideoPipeline's (the same components),
    without it LTX2Pipeline's, and so do a video job's whose reference the SDK uploads (``/v1/videos``); a one-pixel
    picture is a 400 naming ``input_reference`` on both routes."""
    image_row = Family("ltx2", size=64, frames=9, reference=True, pipeline_class="LTX2ImageToVideoPipeline")
    body = {"prompt": "a kite", "size": "64x64", "num_frames": 9, "num_inference_steps": 2, "seed": 4,
            "response_format": "frames"}
    picture = base64.b64encode(encode_png(reference_image(64))).decode()
    thin = base64.b64encode(encode_png(np.zeros((1, 8, 3), np.uint8))).decode()
    job_fields = {k: body[k] for k in ("num_frames", "num_inference_steps", "seed")}
    with httpx.Client(base_url=ltx2_stage.http_url, timeout=120) as http:
        image = http.post("/v1/videos/sync", json={**body, "input_reference": picture})
        text = http.post("/v1/videos/sync", json=body)
        refused = http.post("/v1/videos/sync", json={**body, "input_reference": thin})
    with openai.OpenAI(base_url=f"{ltx2_stage.http_url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        job = client.videos.create_and_poll(prompt="a kite", size="64x64", extra_body=job_fields,
                                            input_reference=("kite.png", base64.b64decode(picture), "image/png"))
        job_frames = zip_frames(client.videos.download_content(job.id, variant="frames").read())
        with pytest.raises(openai.BadRequestError) as thin_job:
            client.videos.create(prompt="a kite", size="64x64", extra_body=job_fields,
                                 input_reference=("thin.png", base64.b64decode(thin), "image/png"))
    assert job.status == "completed" and thin_job.value.body["param"] == "input_reference", (job, thin_job.value.body)
    assert image.status_code == text.status_code == 200, (image.text[:300], text.text[:300])
    image_frames, text_frames = zip_frames(image.content), zip_frames(text.content)
    image_bare = bare_call(image_row, tiny_ltx2_path, "a kite", 2, 4, 3.0)[0]
    text_bare = bare_call(Family("ltx2", size=64, frames=9), tiny_ltx2_path, "a kite", 2, 4, 3.0)[0]
    assert int(np.abs(image_frames.astype(int) - image_bare).max()) <= 2
    assert int(np.abs(job_frames.astype(int) - image_bare).max()) <= 2
    assert int(np.abs(text_frames.astype(int) - text_bare).max()) <= 2
    assert int(np.abs(image_frames.astype(int) - text_frames).max()) > 20
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "input_reference" and "2x2 pixels" in error["message"]


def test_ltx2_sound_is_muxed_as_aac_on_both_routes_and_served_alone_as_wav(tiny_ltx2_path, ltx2_stage):
    """LTX-2 makes sound with its video: the sync MP4 and the job's MP4 each hold an AAC track of the clip's length
    (5312 samples of 16 kHz stereo for 9 frames at 24 fps) beside the H.264 frames; the job's ``variant=audio`` is
    that track alone as WAV, equal to the bare call's ``.audio`` within one 16-bit step (step mode, a worker
    process); a streamed video's MP4 has it too."""
    body = {"prompt": "rain on a tin roof", "size": "64x64", "num_frames": 9, "num_inference_steps": 2, "seed": 8}
    with httpx.Client(base_url=ltx2_stage.http_url, timeout=120) as http:
        sync = http.post("/v1/videos/sync", json=body)
        events = sse_events(http.post("/v1/videos/sync", json={**body, "stream": True}).text)
    with openai.OpenAI(base_url=f"{ltx2_stage.http_url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        job = client.videos.create_and_poll(prompt=body["prompt"], size="64x64",
                                            extra_body={k: body[k] for k in ("num_frames", "num_inference_steps",
                                                                             "seed")})
        job_mp4 = client.videos.download_content(job.id).read()
        wav = client.videos.download_content(job.id, variant="audio")
    bare = bare_pipeline(tiny_ltx2_path)(prompt=body["prompt"], height=64, width=64, num_frames=9,
                                         num_inference_steps=2, generator=generators(8, 1), output_type="np")
    expected = bare.audio[0].float().numpy()
    assert sync.status_code == 200 and sync.headers["Content-Type"] == "video/mp4", sync.text[:300]
    streamed = base64.b64decode(events[-1][1]["b64_json"])
    for mp4 in (sync.content, job_mp4, streamed):
        frames, fps = decode_mp4(mp4)
        track = decode_audio(mp4)
        assert frames.shape == (9, 64, 64, 3) and fps == 24.0
        assert track.sample_rate == 16000 and track.samples.shape[:2] == (1, 2)
        assert 5312 <= track.samples.shape[-1] <= 5312 + 16                 # the container counts milliseconds
    assert wav.response.headers["Content-Type"] == "audio/wav"
    alone = decode_audio(wav.read())
    assert alone.sample_rate == 16000 and alone.samples.shape == (1, 2, 5312)
    np.testing.assert_allclose(alone.samples[0], np.clip(expected, -1, 1), rtol=0, atol=1 / 32767 + 1e-4)
