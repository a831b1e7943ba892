"""The CLI's compile flags and built-in model names: ``--compile``, ``--compile-cache-dir``, ``--compile-shapes``,
``--compile-max-graphs``, ``--compile-timeout-s`` reach the config (validate prints them); a bad one exits 2 naming
it; ``--model tiny-digits`` (the CRD's ``builtin`` names) serves the shipped or built folder."""

from __future__ import annotations

import json

from test_cli import run_cli, run_subprocess

from stage_runtime.cli import builtin_model, build_parser, config_from_args
from stage_runtime.models.tiny import builtin_folder
from stage_runtime.models.tiny.digits import FOLDER


def test_validate_prints_the_compile_settings(capsys):
    rc, out, _ = run_cli(capsys, "validate", "--compile", "regional", "--compile-shapes", "64x64, 832x480x81",
                         "--compile-max-graphs", "12", "--compile-timeout-s", "60", "--compile-cache-dir", "/c")
    assert rc == 0
    assert "compile: regional  shapes: 64x64, 832x480x81  max_graphs: 12  timeout_s: 60  cache_dir: /c" in out


def test_the_flags_fill_the_compile_section():
    args = build_parser().parse_args(["serve", "--model", "/m", "--compile", "full", "--compile-shapes", "32x32"])
    config = config_from_args(args)
    assert (config.compile.mode, config.compile.shapes, config.compile.max_graphs) == ("full", ("32x32",), 64)


def test_a_bad_compile_shape_exits_2_naming_it():
    proc = run_subprocess("validate", "--compile", "regional", "--compile-shapes", "64by64")
    assert proc.returncode == 2 and "compile shape '64by64' must be WIDTHxHEIGHT" in proc.stderr, proc.stderr


def test_builtin_model_names_resolve_to_a_folder(tmp_path):
    assert builtin_model("tiny-digits") == str(FOLDER)
    assert builtin_model(str(tmp_path)) == str(tmp_path)         # an existing folder is taken as it is
    built = builtin_folder("tiny-dit", tmp_path)
    assert json.loads((built / "model_index.json").read_text())["_class_name"] == "DiTPipeline"
    assert builtin_folder("tiny-dit", tmp_path) == built and builtin_folder("tiny-nope", tmp_path) is None


def test_an_unknown_builtin_name_exits_2_listing_the_names(capsys):
    rc, _, err = run_cli(capsys, "validate", "--model", "tiny-nope")
    assert rc == 2 and "--model='tiny-nope': no such folder, and no built-in model of that name" in err
    assert "tiny-digits" in err
