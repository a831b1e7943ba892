"""A quantization the stage cannot serve is a startup error that names the field and its value, exit 2, with the
reason in the termination log (what the operator reports): an unknown method at the command line, fp8 on a device
without FP8 matmuls, a GGUF file that is no GGUF file, a GGUF file whose tensors are another model's."""

from __future__ import annotations

from pathlib import Path

import pytest
from stage_process import StageProcess
from test_cli import run_subprocess

from stage_runtime.models.tiny.gguf_file import write_folder_gguf

ARGS = ["--device", "cpu", "--executor", "uni"]


def test_an_unknown_method_exits_2_naming_it():
    proc = run_subprocess("validate", "--model", "/m", "--quantization", "q4")
    assert proc.returncode == 2 and "--quantization: invalid choice: 'q4'" in proc.stderr, proc.stderr


def exits_2(tmp_path: Path, argv: list[str]) -> str:
    """Start the stage; it must exit 2 by itself; the termination log's reason."""
    term = tmp_path / "termination.log"
    stage = StageProcess([*argv, *ARGS], tmp_path / "stage.log", termination_log=term)
    stage.start(wait_ready=False)
    try:
        assert stage.wait(180) == 2, stage.log[-3000:]
    finally:
        stage.kill()
    return term.read_text()


def test_fp8_on_a_cpu_exits_2_naming_the_device(tiny_dit_path, tmp_path):
    reason = exits_2(tmp_path, ["--model", tiny_dit_path, "--quantization", "fp8"])
    assert reason.startswith("ConfigError: ") and "quantization.method='fp8'" in reason and "cpu" in reason, reason


@pytest.mark.parametrize("bad", ["not-gguf", "another-model"])
def test_a_gguf_file_that_does_not_fit_exits_2_naming_it(tiny_sd_path, tiny_model, tmp_path, bad):
    if bad == "not-gguf":
        file = tmp_path / "unet.gguf"
        file.write_text("model weights, honestly")
        expected = "not a GGUF file"
    else:                                         # the tiny FLUX.1 denoiser given to the tiny SD's UNet
        file = write_folder_gguf(tiny_model("flux"), "Q8_0", out=tmp_path / "transformer.Q8_0.gguf")
        expected = "UNet2DConditionModel"
    reason = exits_2(tmp_path, ["--model", tiny_sd_path, "--quantization", "gguf", "--quantization-file", str(file)])
    assert reason.startswith("ConfigError: ") and f"quantization.file={str(file)!r}" in reason, reason
    assert expected in reason, reason
