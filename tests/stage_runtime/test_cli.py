"""``stage-runtime`` CLI: in-process through ``cli.main`` (capsys) and, for exit codes, as a real subprocess.

Exit codes: 0 ok, 2 configuration / topology / input error (one ``error: ...`` line on stderr).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stage_runtime import model_catalog
from stage_runtime.cli import main
from stage_runtime.models.registry import ADAPTERS, read_pipeline_class

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def run_subprocess(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "stage_runtime", *argv], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


# -- validate ---------------------------------------------------------------------------------------------
def test_validate_bad_topology_exits_2_as_a_real_process():
    proc = run_subprocess("validate", "--num-gpus", "3", "--cfg-parallel-size", "2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ")
    assert "num_gpus=3" in proc.stderr and "cfg_parallel_size(2)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_validate_bad_topology_in_process(capsys):
    rc, out, err = run_cli(capsys, "validate", "--num-gpus", "3", "--cfg-parallel-size", "2")
    assert rc == 2 and out == ""
    assert "num_gpus=3" in err and "cfg_parallel_size(2)" in err


def test_validate_ok_prints_rank_layout(capsys):
    rc, out, err = run_cli(capsys, "validate", "--num-gpus", "4", "--cfg-parallel-size", "2")
    assert rc == 0 and err == ""
    assert "world_size=4" in out and "cfg=2 dp=2" in out
    assert "executor: mp" in out                           # world > 1 resolves to the multiprocess executor
    rank_lines = [line.strip() for line in out.splitlines() if line.strip().startswith("rank ")]
    assert rank_lines == [
        "rank 0: tp=0 sp=0 pp=0 cfg=0 dp=0",
        "rank 1: tp=0 sp=0 pp=0 cfg=1 dp=0",
        "rank 2: tp=0 sp=0 pp=0 cfg=0 dp=1",
        "rank 3: tp=0 sp=0 pp=0 cfg=1 dp=1",
    ]


def test_validate_ok_as_a_real_process():
    proc = run_subprocess("validate", "--num-gpus", "4", "--cfg-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert "world_size=4" in proc.stdout and proc.stdout.count("  rank ") == 4


def test_validate_single_rank_defaults(capsys):
    rc, out, _ = run_cli(capsys, "validate")
    assert rc == 0
    assert "world_size=1" in out and "executor: uni" in out and "max_num_seqs: 1" in out
    assert out.count("  rank ") == 1


@pytest.mark.parametrize("argv, shown", [
    ((), "scheduling_policy: fcfs  max_preemptions: 3  default_timeout_s: None"),
    (("--scheduling-policy", "srpt", "--max-preemptions", "1", "--default-timeout-s", "30"),
     "scheduling_policy: srpt  max_preemptions: 1  default_timeout_s: 30.0"),
])
def test_validate_shows_the_scheduling_policy_flags(capsys, argv, shown):
    rc, out, _ = run_cli(capsys, "validate", *argv)
    assert rc == 0 and shown in out


def test_an_unknown_scheduling_policy_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--scheduling-policy", "lifo"])
    assert exc.value.code == 2 and "--scheduling-policy" in capsys.readouterr().err


def test_the_dlo_flags_make_a_distributed_offload_and_validate_shows_each_ranks_shard_bytes(tiny_sd_path, capsys):
    rc, out, err = run_cli(capsys, "validate", "--model", tiny_sd_path, "--num-gpus", "2",
                           "--enable-distributed-layerwise-offload", "--dlo-use-allgather")
    assert rc == 0 and err == "", err
    assert "offload: distributed  (DLO: all-gather over dp=2; waves of 2 requests)" in out
    shard = [line for line in out.splitlines() if line.strip().startswith("dp rank ")]
    total = int(re.search(r"unet: ([\d,]+) bytes", out).group(1).replace(",", ""))
    at_rest = [int(re.search(r"dp rank \d: ([\d,]+) bytes at rest", line).group(1).replace(",", "")) for line in shard]
    assert len(shard) == 2 and all(0 < b <= 0.55 * total for b in at_rest) and sum(at_rest) >= total, out


def test_dlo_without_data_parallel_ranks_exits_2_naming_the_mode_as_a_real_process():
    proc = run_subprocess("validate", "--num-gpus", "2", "--ulysses-degree", "2",
                          "--enable-distributed-layerwise-offload")
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert "offload.mode='distributed'" in proc.stderr and "dp=1" in proc.stderr, proc.stderr


def test_no_allgather_without_distributed_offload_exits_2_naming_allgather(capsys):
    rc, out, err = run_cli(capsys, "validate", "--num-gpus", "2", "--no-dlo-use-allgather")
    assert rc == 2 and out == ""
    assert "allgather=False only applies to mode='distributed'" in err, err


def test_the_rank_local_variant_validates_as_layerwise_per_rank(capsys):
    rc, out, _ = run_cli(capsys, "validate", "--num-gpus", "2", "--offload", "distributed", "--no-dlo-use-allgather")
    assert rc == 0 and "offload: distributed" in out and "DLO" not in out, out


def test_validate_config_file_with_flag_override(tmp_path, capsys):
    cfg = tmp_path / "stage.yaml"
    cfg.write_text("model:\n  path: /models/whatever\nparallel:\n  num_gpus: 2\n"
                   "scheduler:\n  max_num_seqs: 2\n  execution_mode: request\n")
    rc, out, err = run_cli(capsys, "validate", "--config", str(cfg))
    assert rc == 0, err
    assert "world_size=2" in out and "max_num_seqs: 2" in out

    rc, out, err = run_cli(capsys, "validate", "--config", str(cfg), "--num-gpus", "4", "--max-num-seqs", "8")
    assert rc == 0, err
    assert "world_size=4" in out and "dp=4" in out      # the flag wins over the file
    assert "max_num_seqs: 8" in out
    assert "execution_mode: request" in out             # untouched file values are kept
    assert out.count("  rank ") == 4


def test_validate_a_partial_config_file_without_a_model(tmp_path, capsys):
    cfg = tmp_path / "partial.yaml"
    cfg.write_text("parallel: {cfg_parallel_size: 2}\n")
    rc, out, err = run_cli(capsys, "validate", "--config", str(cfg))
    assert rc == 0, err
    assert "world_size=2" in out and "executor: mp" in out


def test_validate_config_file_unknown_field_exits_2(tmp_path, capsys):
    cfg = tmp_path / "stage.yaml"
    cfg.write_text("model:\n  path: /models/whatever\nparallel:\n  num_gpuz: 2\n")
    rc, out, err = run_cli(capsys, "validate", "--config", str(cfg))
    assert rc == 2 and out == ""
    assert "num_gpuz" in err and "unknown field" in err and str(cfg) in err


def test_validate_missing_config_file_exits_2(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "validate", "--config", str(tmp_path / "nope.yaml"))
    assert rc == 2 and "cannot read config file" in err


def test_validate_uni_executor_on_two_ranks_exits_2(capsys):
    rc, _, err = run_cli(capsys, "validate", "--num-gpus", "2", "--executor", "uni")
    assert rc == 2 and "executor='uni'" in err and "world_size=2" in err


# -- make-tiny-model ----------------------------------------------------------------------------------------
def test_make_tiny_model_dit(tmp_path, capsys):
    out_dir = tmp_path / "tiny-dit"
    rc, out, _ = run_cli(capsys, "make-tiny-model", str(out_dir), "--kind", "dit")
    assert rc == 0 and "wrote tiny dit pipeline" in out
    index = json.loads((out_dir / "model_index.json").read_text())
    assert index["_class_name"] == "DiTPipeline"


def test_make_tiny_model_all_writes_every_kind_each_served_by_its_adapter(tmp_path, capsys):
    """``--all`` (the runtime image's prebuilt models): tiny-<kind> for every kind the adapters declare, each a
    folder whose pipeline class the registry hands to the adapter that declared the kind."""
    rc, out, _ = run_cli(capsys, "make-tiny-model", str(tmp_path), "--all", "--no-demo-loras")
    assert rc == 0
    for family in model_catalog.families():
        for kind in family.tiny_kinds:
            assert f"wrote tiny {kind} pipeline to {tmp_path / f'tiny-{kind}'}" in out
            cls = read_pipeline_class(tmp_path / f"tiny-{kind}")
            assert cls in family.pipeline_classes and ADAPTERS[cls] == family.adapter
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"tiny-{k}" for k in model_catalog.tiny_kinds())


# -- generate -------------------------------------------------------------------------------------------------
def test_generate_a_video_writes_the_mp4_and_the_exact_png_frames(tiny_wan_path, tmp_path, capsys):
    """``--frames 9 --fps 8 --out clip.mp4`` writes an MP4 that plays 9 frames of 16x16 at 8 fps; ``--out DIR/``
    writes frame_0000.png … equal to the bare diffusers call; the MP4 is within the stated PSNR of them."""
    from family_checks import Family, bare_call

    from stage_runtime.videoio import decode_mp4, psnr, read_frames_png

    common = ["generate", "--model", tiny_wan_path, "--prompt", "a fox", "--steps", "2", "--size", "16x16", "--seed",
              "3", "--frames", "9", "--fps", "8", "--guidance", "6", "--device", "cpu"]
    rc, out, err = run_cli(capsys, *common, "--out", str(tmp_path / "clip.mp4"))
    assert rc == 0, err
    assert "9 frames of 16x16 at 8 fps, H.264 MP4" in out
    rc, out, err = run_cli(capsys, *common, "--out", f"{tmp_path / 'frames'}/")
    assert rc == 0 and "9 PNG frames of 16x16" in out, err
    frames = read_frames_png(tmp_path / "frames")
    reference = bare_call(Family("wan", size=16, frames=9), tiny_wan_path, "a fox", 2, 3, 6.0)[0]
    assert int(np.abs(frames.astype(int) - reference).max()) <= 1
    decoded, fps = decode_mp4((tmp_path / "clip.mp4").read_bytes())
    assert decoded.shape == (9, 16, 16, 3) and fps == 8 and psnr(decoded, frames) >= 27.0


def test_generate_image_to_video_starts_from_the_given_picture(tiny_wan_i2v_path, tmp_path, capsys):
    """``--image`` on an image-to-video model: the exact frames equal WanImageToVideoPipeline's with that image."""
    from family_checks import Family, bare_call, reference_image

    from stage_runtime.imageio import encode_png
    from stage_runtime.videoio import read_frames_png

    (tmp_path / "first.png").write_bytes(encode_png(reference_image(16)))
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_wan_i2v_path, "--prompt", "a fox", "--steps", "2",
                           "--size", "16x16", "--seed", "3", "--frames", "9", "--guidance", "5",
                           "--image", str(tmp_path / "first.png"), "--out", f"{tmp_path / 'frames'}/", "--device", "cpu")
    assert rc == 0, err
    reference = bare_call(Family("wan-i2v", size=16, frames=9, reference=True), tiny_wan_i2v_path, "a fox", 2, 3, 5.0)
    assert int(np.abs(read_frames_png(tmp_path / "frames").astype(int) - reference[0]).max()) <= 1
    rc, _, err = run_cli(capsys, "generate", "--model", tiny_wan_i2v_path, "--prompt", "a fox", "--size", "16x16",
                         "--frames", "9", "--out", str(tmp_path / "c.mp4"), "--device", "cpu")
    assert rc == 2 and "input_reference=None: WanImageToVideoPipeline makes a video from an image: give one" in err


def test_generate_with_an_image_on_ltx2_runs_its_image_to_video(tiny_ltx2_path, tmp_path, capsys):
    """LTX-2 takes a picture optionally: ``--image`` gives LTX2ImageToVideoPipeline's frames (the same model)."""
    from family_checks import Family, bare_call, reference_image

    from stage_runtime.imageio import encode_png
    from stage_runtime.videoio import read_frames_png

    (tmp_path / "first.png").write_bytes(encode_png(reference_image(64)))
    rc, _, err = run_cli(capsys, "generate", "--model", tiny_ltx2_path, "--prompt", "a kite", "--steps", "2",
                         "--size", "64x64", "--seed", "3", "--frames", "9", "--image", str(tmp_path / "first.png"),
                         "--out", f"{tmp_path / 'frames'}/", "--device", "cpu")
    assert rc == 0, err
    image_row = Family("ltx2", size=64, frames=9, reference=True, pipeline_class="LTX2ImageToVideoPipeline")
    reference = bare_call(image_row, tiny_ltx2_path, "a kite", 2, 3, 3.0)
    assert int(np.abs(read_frames_png(tmp_path / "frames").astype(int) - reference[0]).max()) <= 1


def test_generate_a_frame_count_off_the_rule_exits_2_naming_it(tiny_wan_path, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "generate", "--model", tiny_wan_path, "--prompt", "x", "--size", "16x16",
                         "--frames", "10", "--out", str(tmp_path / "c.mp4"), "--device", "cpu")
    assert rc == 2 and "num_frames=10: WanPipeline takes 4k+1 frames (9, 13 are the nearest)" in err



def test_generate_writes_png_and_prints_timing(tiny_sd_path, tmp_path, capsys):
    png = tmp_path / "sub" / "F.png"
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_sd_path, "--prompt", "x", "--steps", "2",
                           "--size", "64x64", "--seed", "1", "--out", str(png), "--device", "cpu")
    assert rc == 0, err
    with Image.open(png) as img:
        img.load()
        assert img.format == "PNG" and img.size == (64, 64) and img.mode == "RGB"
    lines = out.strip().splitlines()
    assert "64x64 PNG" in lines[0] and str(png.resolve()) in lines[0]
    timing = json.loads(lines[-1])
    assert set(timing) == {"engine_start_s", "generate_s", "queue_ms", "exec_ms", "save_s"}
    assert all(isinstance(v, (int, float)) and v >= 0 for v in timing.values())


def test_generate_partial_config_file_merges_with_flags(tiny_sd_path, tmp_path, capsys):
    """Regression: a file holding only ``offload:`` failed with ``model: Field required`` (validated before
    the flags were merged). Validated once after merging, it serves and gives the image of no offload."""
    config = tmp_path / "off.yaml"
    config.write_text("offload: {mode: layerwise}\n")
    images = {}
    for name, extra in (("plain", ()), ("offload", ("--config", str(config)))):
        png = tmp_path / f"{name}.png"
        rc, _, err = run_cli(capsys, "generate", "--model", tiny_sd_path, "--prompt", "a cat", "--steps", "3",
                             "--seed", "5", "--device", "cpu", "--out", str(png), *extra)
        assert rc == 0, err
        with Image.open(png) as img:
            images[name] = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert np.abs(images["plain"] - images["offload"]).max() <= 1


def test_generate_config_file_error_names_the_file_and_the_field(tiny_sd_path, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("offload: {mode: sideways}\n")
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_sd_path, "--prompt", "x", "--config", str(config),
                           "--out", str(tmp_path / "F.png"))
    assert rc == 2 and out == ""
    assert str(config) in err and "offload.mode" in err and "sideways" in err


def test_generate_bad_size_format_exits_2(tiny_sd_path, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_sd_path, "--prompt", "x", "--steps", "2",
                           "--size", "64by64", "--out", str(tmp_path / "F.png"))
    assert rc == 2 and out == ""
    assert err.startswith("error: size=") and "64by64" in err
    assert not (tmp_path / "F.png").exists()


def test_generate_size_not_multiple_of_8_exits_2(tiny_sd_path, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "generate", "--model", tiny_sd_path, "--prompt", "x", "--steps", "2",
                         "--size", "60x64", "--device", "cpu", "--out", str(tmp_path / "F.png"))
    assert rc == 2
    assert "width=60" in err and "multiple of 8" in err
    assert not (tmp_path / "F.png").exists()


def test_generate_nonexistent_model_exits_2(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "generate", "--model", "/nonexistent", "--prompt", "x",
                           "--out", str(tmp_path / "F.png"))
    assert rc == 2 and out == ""
    assert "model_index.json" in err and "/nonexistent" in err


def test_generate_without_model_exits_2(capsys):
    rc, _, err = run_cli(capsys, "generate", "--prompt", "x")
    assert rc == 2 and "--model" in err


def test_generate_mp_with_a_bad_model_dir_exits_2_naming_the_rank(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    rc, out, err = run_cli(capsys, "generate", "--model", str(tmp_path / "model"), "--prompt", "x", "--steps", "2",
                           "--executor", "mp", "--device", "cpu", "--out", str(tmp_path / "F.png"))
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and "worker rank 0" in err and "model_index.json" in err


def test_generate_cfg_parallel_on_a_generic_pipeline_exits_2_naming_the_class_and_degree(tiny_pag_path, tmp_path,
                                                                                        capsys):
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_pag_path, "--prompt", "x", "--steps", "2",
                           "--cfg-parallel-size", "2", "--device", "cpu", "--out", str(tmp_path / "F.png"))
    assert rc == 2 and out == "" and not (tmp_path / "F.png").exists()
    assert "cfg_parallel_size=2 is not supported by StableDiffusionPAGPipeline" in err
    assert "the generic diffusers adapter runs it as a black box in request mode" in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--steps", "many"])
    assert exc.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_make_tiny_flux_then_generate_writes_the_pipelines_png(tmp_path, capsys):
    """``make-tiny-model --kind flux`` then ``generate --model`` it: a 64x64 PNG equal to the bare
    FluxPipeline call with the same seed (the model's default guidance 3.5)."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    model, png = tmp_path / "tiny-flux", tmp_path / "flux.png"
    rc, out, err = run_cli(capsys, "make-tiny-model", str(model), "--kind", "flux")
    assert rc == 0 and "wrote tiny flux pipeline" in out, err
    rc, out, err = run_cli(capsys, "generate", "--model", str(model), "--prompt", "a red fox", "--steps", "2",
                           "--size", "64x64", "--seed", "7", "--out", str(png), "--device", "cpu")
    assert rc == 0, err
    assert "64x64 PNG" in out
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (64, 64)
        got = np.asarray(img.convert("RGB"))
    pipe = DiffusionPipeline.from_pretrained(model, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe("a red fox", height=64, width=64, num_inference_steps=2, guidance_scale=3.5, output_type="np",
               generator=torch.Generator().manual_seed(7)).images[0]
    ref = (ref * 255).round().clip(0, 255).astype(np.uint8)
    assert got.std() > 10 and np.abs(got.astype(int) - ref.astype(int)).max() <= 1


def test_lora_flags_become_pinned_startup_adapters_and_a_bad_one_names_the_flag():
    from stage_runtime.cli import build_parser, config_from_args
    from stage_runtime.errors import ConfigError

    parser = build_parser()
    args = parser.parse_args(["validate", "--model", "/m", "--lora", "pixel=/a/pixel.safetensors", "--lora",
                              "ink=/a/ink", "--max-loras", "3"])
    config = config_from_args(args)
    assert [(s.name, s.path, s.pinned) for s in config.loras] == [("pixel", "/a/pixel.safetensors", True),
                                                                   ("ink", "/a/ink", True)]
    assert config.max_loras == 3
    with pytest.raises(ConfigError, match=r"--lora='pixel': give NAME=PATH"):
        config_from_args(parser.parse_args(["validate", "--model", "/m", "--lora", "pixel"]))
