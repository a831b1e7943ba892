"""Two replicas of a video stage for the job API's tests: real stage processes serving the tiny Wan on one job store
(A runs the multiprocess executor, B the in-process one), the official SDK for each, and reading what they answer."""

from __future__ import annotations

import contextlib
import io
import zipfile
from pathlib import Path

import numpy as np
import openai
from PIL import Image
from stage_process import StageProcess


@contextlib.contextmanager
def replicas(model: str, folder: Path, store_args: list[str], config: str, extra: tuple[list[str], list[str]] = ([], [])):
    """Two stage processes on one job store (``store_args``: ``--job-store …``), started together, each with its own
    ``extra`` flags; each drained to exit 0 at the end, leaving nothing behind."""
    (folder / "stage.yaml").write_text(config)
    common = ["--model", model, "--served-name", "tiny-wan", "--config", str(folder / "stage.yaml"),
              "--device", "cpu", "--execution-mode", "step", *store_args]
    stages = [StageProcess([*common, "--executor", "mp", *extra[0]], folder / "a.log"),
              StageProcess([*common, "--executor", "uni", *extra[1]], folder / "b.log")]
    try:
        for stage in stages:
            stage.start(wait_ready=False)
        for stage in stages:
            stage.wait_ready()
        yield stages
        for stage in stages:
            assert stage.stop() == 0, stage.log[-3000:]
            stage.assert_no_leaks()
    finally:
        for stage in stages:
            stage.kill()


def sdk(stage: StageProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stage.http_url}/v1", api_key="none", max_retries=0, timeout=60)


def owner_of(stages, video) -> StageProcess:
    """The stage process running ``video`` (its record's owner is host-pid)."""
    pid = int(video.diffstage["owner"].rsplit("-", 1)[1])
    return next(stage for stage in stages if stage.proc.pid == pid)


def zip_frames(content: bytes) -> np.ndarray:
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        return np.stack([np.asarray(Image.open(io.BytesIO(archive.read(n))).convert("RGB"))
                         for n in sorted(archive.namelist())])
