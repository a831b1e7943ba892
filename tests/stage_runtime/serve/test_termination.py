"""Exit codes, the termination message, and the serve flags in the stage config (pure; no process)."""

from __future__ import annotations

import pytest

from stage_runtime.cli import build_parser, config_from_args
from stage_runtime.errors import ConfigError, EngineDeadError, EngineStartupError, ModelLoadError
from stage_runtime.serve.termination import (MAX_MESSAGE_BYTES, exit_code_for, reason_for, termination_log_path,
                                             write_termination_log)


@pytest.mark.parametrize("exc,code,reason", [
    (ConfigError("bad"), 2, "ConfigError"), (ModelLoadError("gone"), 2, "ModelLoadError"),
    (EngineDeadError("rank 1 (pid 9) killed by signal 9"), 3, "WorkerDied"),
    (EngineStartupError("warmup failed"), 1, "EngineStartupError"), (OSError("address in use"), 1, "OSError"),
])
def test_exit_codes_and_reasons(exc, code, reason):
    assert exit_code_for(exc) == code and reason_for(exc) == reason


def test_termination_message_is_one_bounded_line(tmp_path):
    path = tmp_path / "termination-log"
    line = write_termination_log(str(path), "WorkerDied", "rank 1 (pid 4242)\nkilled by   signal 9")
    assert line == "WorkerDied: rank 1 (pid 4242) killed by signal 9"
    assert path.read_text() == line + "\n"
    long = write_termination_log(str(path), "ConfigError", "é" * 5000)
    assert len(long.encode()) <= MAX_MESSAGE_BYTES and path.read_text().count("\n") == 1


def test_termination_log_path_defaults_only_when_the_kubelet_file_exists(tmp_path):
    assert termination_log_path(str(tmp_path / "x")) == str(tmp_path / "x")
    import os
    assert termination_log_path(None) == ("/dev/termination-log" if os.path.exists("/dev/termination-log") else None)


def serve_config(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_serve_flags_override_the_config_file(tmp_path):
    cfg = tmp_path / "stage.yaml"
    cfg.write_text("model: {path: /models/m}\nserver: {http_port: 9000, zmq_port: 9001, drain_timeout: 5}\n")
    config = serve_config("--config", str(cfg), "--http-port", "8080", "--termination-log", "/tmp/t")
    s = config.server
    assert (s.host, s.http_port, s.zmq_port, s.drain_timeout) == ("0.0.0.0", 8080, 9001, 5.0)
    assert s.termination_log == "/tmp/t"
    defaults = serve_config("--model", "/m").server
    assert (defaults.http_port, defaults.zmq_port, defaults.drain_timeout) == (8000, 5570, 25.0)


@pytest.mark.parametrize("argv,needle", [
    (["--http-port", "7000", "--zmq-port", "7000"], "http_port=7000 and zmq_port=7000 must differ"),
    (["--http-port", "70000"], "server.http_port=70000"),
    (["--drain-timeout", "-1"], "server.drain_timeout=-1.0"),
])
def test_bad_serve_flags_are_config_errors(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        serve_config("--model", "/m", *argv)


def test_a_serve_command_line_that_does_not_parse_exits_2_with_the_reason(tmp_path, capsys):
    from stage_runtime.cli import main

    log = tmp_path / "termination-log"
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", "/m", "--http-prot", "1", f"--termination-log={log}"])
    assert info.value.code == 2
    assert log.read_text().startswith("ConfigError: invalid command line: unrecognized arguments: --http-prot 1")
    with pytest.raises(SystemExit):
        main(["serve", "--termination-log", str(log), "--max-num-seqs", "many"])
    assert "argument --max-num-seqs: invalid int value: 'many'" in log.read_text()
    capsys.readouterr()
