"""The playground's video path in a real headless Chromium against a real tiny Wan stage with a job store and a
LoRA adapter: the form offers the family's frame counts and the adapter; Generate creates a job through
``/v1/videos`` with what was chosen, shows its progress from polling, and ends in a ``<video>`` that Chromium
plays for frames ÷ fps seconds, with its thumbnail and a download link; Abort deletes a running job; a size the
family cannot take is refused on the page, naming the size, before anything is sent. A stage without a job store
makes the video through ``/v1/videos/sync`` (streamed phases) instead, and it plays the same way."""

from __future__ import annotations

import json

import httpx
import pytest
from lora_probes import write_adapter
from stage_process import running_stage

from support.browser import chromium, open_page, screenshot_dir

FRAMES, FPS = 9, 8


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


def wan_args(model: str, folder, config_text: str, *extra: str) -> list[str]:
    config = folder / "stage.yaml"
    config.write_text(f"warmup: false\n{config_text}")
    return ["--model", model, "--config", str(config), "--device", "cpu", "--executor", "uni", "--execution-mode",
            "step", *extra]


@pytest.fixture(scope="module")
def wan_stage(browser, tiny_wan_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("playground-wan")
    lora = write_adapter(tiny_wan_path, folder / "fast", seed=1, text_encoder=False, gain=1.0)
    config = f"jobs: {{poll_after_ms: 50}}\nloras:\n  - name: fast\n    path: {lora}\n"
    with running_stage(wan_args(tiny_wan_path, folder, config, "--job-store", str(folder / "jobs")),
                       folder / "stage.log") as stage:
        yield stage


def fill_video(page, prompt: str, steps: int) -> None:
    page.wait_for_selector("body[data-ready='1']")
    page.fill("#prompt", prompt)
    page.fill("#width", "32")
    page.fill("#height", "32")
    page.select_option("#frames", str(FRAMES))
    page.fill("#fps", str(FPS))
    page.fill("#steps", str(steps))
    page.fill("#seed", "5")


def test_a_video_job_with_a_lora_ends_in_a_video_that_plays_frames_over_fps_seconds(browser, wan_stage, tmp_path):
    shots = screenshot_dir(tmp_path)
    with open_page(browser, f"{wan_stage.http_url}/") as (page, watch):
        page.wait_for_selector("body[data-ready='1']")
        assert page.is_visible("#frames") and not page.is_visible("#count")
        offered = [int(v) for v in page.eval_on_selector_all("#frames option", "options => options.map(o => o.value)")]
        assert FRAMES in offered and all((f - 1) % 4 == 0 for f in offered)        # Wan's 4k+1
        sent = []
        page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/v1/videos") else None)
        fill_video(page, "a red fox in the snow", steps=4)
        page.check("input[data-lora='fast']")
        page.fill("input[data-lora-scale='fast']", "0.8")
        page.click("#generate")
        card = page.wait_for_selector(".card[data-video-id]")
        video_id = card.get_attribute("data-video-id")
        page.wait_for_selector(".card[data-state='completed'] video.output", timeout=180_000)
        duration = page.wait_for_function(
            "() => { const v = document.querySelector('video.output'); return v.readyState >= 1 && v.duration; }",
            timeout=60_000).json_value()
        page.screenshot(path=str(shots / "playground-video.png"))
        assert sent == [{"model": sent[0]["model"], "prompt": "a red fox in the snow", "num_inference_steps": 4,
                         "seed": 5, "guidance_scale": sent[0]["guidance_scale"], "loras": [{"name": "fast",
                                                                                            "scale": 0.8}],
                         "size": "32x32", "num_frames": FRAMES, "fps": FPS}]
        assert abs(duration - FRAMES / FPS) < 0.5 / FPS, duration
        assert page.get_attribute(".card img.thumbnail", "src").startswith("blob:")
        assert page.get_attribute(".card a.download", "download") == f"{video_id}.mp4"
        assert page.inner_text(".card .status") == f"{FRAMES} frames at {FPS} fps · 32x32"
    job = httpx.get(f"{wan_stage.http_url}/v1/videos/{video_id}").json()
    assert job["status"] == "completed" and job["diffstage"]["num_frames"] == FRAMES


def test_a_size_the_family_cannot_take_is_refused_on_the_page_naming_it(browser, wan_stage):
    with open_page(browser, f"{wan_stage.http_url}/") as (page, watch):
        page.wait_for_selector("body[data-ready='1']")
        page.fill("#prompt", "a fox")
        page.fill("#width", "40")
        page.fill("#height", "32")
        page.click("#generate")
        page.wait_for_selector("#form-error:has-text('size: 40x32')")
        assert page.query_selector(".card") is None


def test_abort_deletes_the_running_job(browser, wan_stage):
    with open_page(browser, f"{wan_stage.http_url}/") as (page, watch):
        fill_video(page, "a long fox", steps=999)
        page.click("#generate")
        page.wait_for_selector(".card[data-video-id] .status:has-text('denoising')", timeout=120_000)
        card = page.query_selector(".card[data-video-id]")
        video_id = card.get_attribute("data-video-id")
        card.query_selector("button.abort").click()
        page.wait_for_selector(".card[data-state='aborted']", timeout=60_000)
    assert httpx.get(f"{wan_stage.http_url}/v1/videos/{video_id}").status_code == 404


def test_without_a_job_store_the_video_streams_from_the_sync_route_and_plays(browser, tiny_wan_path, tmp_path):
    with running_stage(wan_args(tiny_wan_path, tmp_path, ""), tmp_path / "stage.log") as stage, \
            open_page(browser, f"{stage.http_url}/") as (page, watch):
        fill_video(page, "a red fox in the snow", steps=4)
        page.click("#generate")
        page.wait_for_selector(".card[data-kind='video-sync'][data-state='completed'] video.output", timeout=180_000)
        duration = page.wait_for_function(
            "() => { const v = document.querySelector('video.output'); return v.readyState >= 1 && v.duration; }",
            timeout=60_000).json_value()
        assert abs(duration - FRAMES / FPS) < 0.5 / FPS, duration
        assert page.inner_text(".card .status") == f"{FRAMES} frames at {FPS} fps · 32x32"
