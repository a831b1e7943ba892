"""The playground in a real headless Chromium against a real keyed stage serving the trained ``tiny-digits`` in step
mode: the page asks for the key and refuses to go on without the right one; typing "7" streams progress and partial
images before the final image, which the digit judge reads as a 7, while a second request runs on its own card; a
prompt of markup is shown as text, never parsed; Abort ends the request it belongs to."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from stage_process import running_stage

from stage_runtime.models.tiny.digit_judge import load_judge
from support.browser import chromium, image_of, open_page, screenshot_dir
from support.waiting import wait_until

KEY = "sk-playground-test"
STAGE = ["--model", "tiny-digits", "--device", "cpu", "--execution-mode", "step", "--max-num-seqs", "4"]
# every card's state after each change of the cards (the test reads the order in which things appeared)
RECORD_CARDS = """() => {
  window.cardLog = [];
  const record = () => document.querySelectorAll('.card').forEach((card) => window.cardLog.push({
    prompt: card.querySelector('.prompt').textContent, state: card.dataset.state, step: Number(card.dataset.step || 0),
    partials: Number(card.dataset.partials), finals: card.querySelectorAll('img[data-final]').length}));
  new MutationObserver(record).observe(document.getElementById('cards'),
                                       {subtree: true, childList: true, attributes: true});
}"""


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


@pytest.fixture(scope="module")
def keyed_stage(browser, tmp_path_factory):
    folder = tmp_path_factory.mktemp("playground-stage")
    (folder / "keys").write_text(f"{KEY}\n")
    with running_stage([*STAGE, "--api-key-file", str(folder / "keys")], folder / "stage.log") as stage:
        yield stage


def unlock(page) -> None:
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    page.wait_for_selector("body[data-ready='1']")


def generate(page, prompt: str, steps: int, count: int = 1, seed: int | None = None) -> None:
    page.fill("#prompt", prompt)
    page.fill("#steps", str(steps))
    page.fill("#count", str(count))
    page.fill("#seed", "" if seed is None else str(seed))
    page.click("#generate")


def card(prompt: str) -> str:
    return f".card:has(.prompt:text-is({prompt!r}))"


def test_a_keyed_stage_asks_for_the_key_refuses_a_wrong_one_and_serves_with_the_right_one(browser, keyed_stage):
    with open_page(browser, f"{keyed_stage.http_url}/") as (page, watch):
        page.wait_for_selector("#key-dialog[open]")
        assert "needs an API key" in page.inner_text("#key-message")
        assert page.is_disabled("#generate") and page.get_attribute("body", "data-ready") is None
        page.fill("#key-input", "sk-wrong")
        page.click("#key-submit")
        page.wait_for_selector("#key-dialog[open] >> text=The API key was refused")
        assert page.is_disabled("#generate")
        page.fill("#key-input", KEY)
        page.click("#key-submit")
        page.wait_for_selector("body[data-ready='1']")
        served = httpx.get(f"{keyed_stage.http_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert page.inner_text("#model-name") == served["data"][0]["id"]
        assert "DiTPipeline" in page.inner_text("#model-facts")
        assert page.is_enabled("#generate")
        # kept for this tab only
        assert page.evaluate("sessionStorage.getItem('diffstage.apiKey')") == KEY
        assert page.evaluate("localStorage.length") == 0


def test_a_7_streams_progress_and_partial_images_then_a_final_7_beside_another_request(browser, keyed_stage,
                                                                                        tmp_path):
    shots = screenshot_dir(tmp_path)
    with open_page(browser, f"{keyed_stage.http_url}/") as (page, watch):
        unlock(page)
        assert page.is_visible("#partials")                  # step mode: previews are offered
        page.evaluate(RECORD_CARDS)
        generate(page, "7", steps=120, count=2, seed=1)
        generate(page, "3", steps=80, seed=2)
        page.wait_for_selector(f"{card('7')} img[data-partial]", timeout=120_000)
        page.screenshot(path=str(shots / "playground-generating.png"))
        for prompt in ("7", "3"):
            page.wait_for_selector(f"{card(prompt)}[data-state='completed']", timeout=120_000)
        page.screenshot(path=str(shots / "playground-finished.png"))
        log = page.evaluate("window.cardLog")
        sevens = [entry for entry in log if entry["prompt"] == "7"]
        assert len({e["step"] for e in sevens if 0 < e["step"] < 120}) >= 5       # the bar advanced step by step
        first_final = next(i for i, e in enumerate(sevens) if e["finals"])
        assert any(e["partials"] for e in sevens[:first_final])                   # a partial image before the final
        assert sevens[-1]["finals"] == 2 and sevens[-1]["state"] == "completed"
        assert int(page.get_attribute(card("7"), "data-partials")) >= 2          # each output's previews
        judge = load_judge()
        for prompt, count in (("7", 2), ("3", 1)):
            images = [image_of(page, f"{card(prompt)} img[data-index='{i}']") for i in range(count)]
            assert [int(d) for d in judge.classify(np.stack(images))] == [int(prompt)] * count
    for name in ("playground-generating.png", "playground-finished.png"):
        assert (shots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_prompt_of_markup_is_shown_as_text(browser, keyed_stage):
    markup = "<img src=x onerror=alert(1)>"
    with open_page(browser, f"{keyed_stage.http_url}/") as (page, watch):
        unlock(page)
        generate(page, markup, steps=4)
        done = page.wait_for_selector(".card[data-state='completed']")
        assert done.query_selector(".prompt").inner_text() == markup             # the characters, as typed
        assert page.evaluate("document.querySelectorAll('img[src=\"x\"], [onerror]').length") == 0
        assert page.evaluate("document.querySelector('.card .prompt').children.length") == 0
    assert not watch.dialogs                                                      # no alert ran


def test_abort_ends_the_running_request_and_only_it(browser, keyed_stage):
    auth = {"Authorization": f"Bearer {KEY}"}
    with open_page(browser, f"{keyed_stage.http_url}/") as (page, watch):
        unlock(page)
        generate(page, "5", steps=900, seed=3)
        running = page.wait_for_selector(".card[data-step]:not([data-step='0'])", timeout=120_000)
        request_id = running.get_attribute("data-request-id")
        generate(page, "2", steps=30, seed=4)
        running.query_selector("button.abort").click()
        page.wait_for_selector(f".card[data-request-id='{request_id}'][data-state='aborted']")
        page.wait_for_selector(f"{card('2')}[data-state='completed']", timeout=120_000)
    wait_until(lambda: httpx.get(f"{keyed_stage.http_url}/v1/requests", headers=auth).json()["requests"] == [],
               what="no request left on the stage")


def test_serve_prints_the_pages_url(keyed_stage):
    assert f"playground: open {keyed_stage.http_url}/ in a browser" in keyed_stage.log
