"""``stage-runtime``: serve, generate, validate, make-tiny-model, fetch-model (stage_runtime.fetch.command),
train-tiny (stage_runtime.train.command).

Exit codes (docs/stage-process.md): 0 ok, 2 configuration / topology / input error, 1 anything unexpected;
``serve`` also exits 3 when the engine died, and writes ``Reason: message`` to its termination log.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from stage_runtime.cli_serve import add_serve_flags
from stage_runtime.cli_output import write_output
from stage_runtime.config import StageConfig, load_config, load_config_file, merge_overrides
from stage_runtime.errors import ConfigError, InvalidRequestError, ModelLoadError
from stage_runtime.fetch.command import add_parser as add_fetch_parser
from stage_runtime.models.tiny import KINDS as TINY_KINDS
from stage_runtime.models.tiny.gguf_file import WRITABLE as GGUF_QUANTS
from stage_runtime.train.command import add_parser as add_train_parser
from stage_runtime.weight_layout import describe_dlo

# CLI flag → (section, field) of StageConfig.
ENGINE_FLAGS = {
    "model": ("model", "path"), "served_name": ("model", "served_name"), "dtype": ("model", "dtype"),
    "device": (None, "device"), "executor": (None, "executor"),
    "num_gpus": ("parallel", "num_gpus"), "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "ulysses_degree": ("parallel", "ulysses_degree"), "ring_degree": ("parallel", "ring_degree"),
    "cfg_parallel_size": ("parallel", "cfg_parallel_size"), "data_parallel_size": ("parallel", "data_parallel_size"),
    "pipeline_parallel_size": ("parallel", "pipeline_parallel_size"),
    "execution_mode": ("scheduler", "execution_mode"), "max_num_seqs": ("scheduler", "max_num_seqs"),
    "request_batch_max_wait_ms": ("scheduler", "request_batch_max_wait_ms"),
    "max_waiting": ("scheduler", "max_waiting"),
    "scheduling_policy": ("scheduler", "scheduling_policy"), "max_preemptions": ("scheduler", "max_preemptions"),
    "default_timeout_s": ("scheduler", "default_timeout_s"),
    "host": ("server", "host"), "http_port": ("server", "http_port"), "zmq_port": ("server", "zmq_port"),
    "drain_timeout": ("server", "drain_timeout"), "termination_log": ("server", "termination_log"),
    "api_key_file": ("server", "api_key_file"), "max_upload_bytes": ("server", "max_upload_bytes"),
    "max_image_pixels": ("server", "max_image_pixels"),
    "startup_timeout": ("server", "startup_timeout"), "playground": ("server", "playground"),
    "job_store": ("jobs", "store"), "job_retention_s": ("jobs", "retention_s"), "job_lease_s": ("jobs", "lease_s"),
    "job_checkpoint_every_steps": ("jobs", "checkpoint_every_steps"), "job_store_endpoint": ("jobs", "endpoint"),
    "job_store_region": ("jobs", "region"), "job_presigned_content": ("jobs", "presigned_content"),
    "cache_mode": ("cache", "mode"), "cache_threshold": ("cache", "threshold"),
    "cache_warmup_steps": ("cache", "warmup_steps"), "cache_final_steps": ("cache", "final_steps"),
    "result_cache_bytes": ("cache", "result_max_bytes"), "prompt_cache_bytes": ("cache", "prompt_max_bytes"),
    "max_loras": (None, "max_loras"),
    "max_request_cost": ("limits", "max_request_cost"), "stall_unready_s": ("limits", "stall_unready_s"),
    "stall_fail_s": ("limits", "stall_fail_s"), "decode_tile_side": ("limits", "decode_tile_side"),
    "compile": ("compile", "mode"), "compile_cache_dir": ("compile", "cache_dir"),
    "compile_max_graphs": ("compile", "max_graphs"), "compile_timeout_s": ("compile", "timeout_s"),
    "quantization": ("quantization", "method"), "quantization_file": ("quantization", "file"),
    "enable_sleep_mode": ("sleep", "enabled"), "sleep_level": ("sleep", "level"),
    "sleep_after_idle_s": ("sleep", "after_idle_s"), "sleep_drain_timeout_s": ("sleep", "drain_timeout_s"),
    "sleep_wake_timeout_s": ("sleep", "wake_timeout_s"),
    "profiler_dir": ("profiler", "dir"), "profiler_max_seconds": ("profiler", "max_seconds"),
    "offload": ("offload", "mode"), "dlo_use_allgather": ("offload", "allgather"),
}


def parse_lora_flag(value: str) -> dict:
    """``--lora NAME=PATH`` → a LoraSpec dict (validated with the rest of the config)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora={value!r}: give NAME=PATH (a LoRA safetensors file or its folder)")
    return {"name": name, "path": path}


def add_engine_flags(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("--config", help="stage.yaml (explicit flags win over it)")
    p.add_argument("--model", required=model_required, help="local diffusers pipeline folder, or a built-in tiny "
                                                            "model's name (tiny-digits, tiny-sd, ...)")
    p.add_argument("--served-name")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--executor", help="uni | mp | package.module:Class")
    for flag in ("num-gpus", "tensor-parallel-size", "ulysses-degree", "ring-degree", "cfg-parallel-size",
                 "data-parallel-size", "pipeline-parallel-size", "max-num-seqs", "max-waiting", "max-preemptions"):
        p.add_argument(f"--{flag}", type=int)
    p.add_argument("--execution-mode", choices=["request", "step"])
    p.add_argument("--request-batch-max-wait-ms", type=float)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority", "srpt"])
    p.add_argument("--default-timeout-s", type=float)
    p.add_argument("--cache-mode", choices=["none", "block"], help="block: per-request first-block residual cache")
    p.add_argument("--cache-threshold", type=float, help="block cache: skip while the relative change is under it")
    for flag in ("cache-warmup-steps", "cache-final-steps", "result-cache-bytes", "prompt-cache-bytes"):
        p.add_argument(f"--{flag}", type=int)
    p.add_argument("--lora", action="append", metavar="NAME=PATH",
                   help="a LoRA adapter loaded (and pinned) at startup; repeatable")
    p.add_argument("--max-loras", type=int, help="resident LoRA adapters at most (default 8; LRU among unpinned)")
    p.add_argument("--max-request-cost", type=int, help="most pixels x steps x outputs one request may cost (default: "
                                                        "1000 steps of one output at the model's native size)")
    p.add_argument("--stall-unready-s", type=float, help="a running request makes no step progress this long: "
                                                         "/ready 503 (default 120)")
    p.add_argument("--stall-fail-s", type=float, help="... this long: fail closed, exit 3 StepStalled (default 600)")
    p.add_argument("--compile", choices=["none", "auto", "regional", "full"],
                   help="compile the denoiser: regional (each repeated block class once), full, auto (where measured "
                        "faster), none (default: eager)")
    p.add_argument("--compile-cache-dir", help="compiled artifacts, kept across restarts (default: torch's)")
    p.add_argument("--compile-shapes", help="sizes compiled at warm-up, comma-separated WIDTHxHEIGHT[xFRAMES] "
                                            "(default: the model's default size)")
    p.add_argument("--compile-max-graphs", type=int, help="graphs a rank compiles at most; past it new shapes run "
                                                          "eagerly (default 64)")
    p.add_argument("--compile-timeout-s", type=float, help="the warm-up's compile bound; past it the stage serves "
                                                           "eagerly and says so (default 900)")
    p.add_argument("--quantization", choices=["none", "fp8-storage", "int8-weight", "fp8", "gguf"],
                   help="store the denoiser's weights quantized (docs/quantization.md; default none)")
    p.add_argument("--quantization-file", help="gguf: the .gguf denoiser (relative: inside the model folder)")
    p.add_argument("--quantization-components", help="components quantized, comma-separated (default: the denoiser)")
    p.add_argument("--quantization-skip", help="module-name patterns kept as loaded, comma-separated")
    p.add_argument("--enable-sleep-mode", action="store_true", default=None,
                   help="POST /sleep, /wake_up, GET /is_sleeping: give the weights' memory back while idle "
                        "(docs/sleep-and-profile.md)")
    p.add_argument("--sleep-level", type=int, choices=[1, 2], help="the level the stage sleeps itself at (default 1)")
    p.add_argument("--sleep-after-idle-s", type=float, help="sleep after this many seconds without work (default: "
                                                            "only POST /sleep)")
    p.add_argument("--sleep-drain-timeout-s", type=float, help="a sleep waits this long for running requests "
                                                               "(default 30)")
    p.add_argument("--sleep-wake-timeout-s", type=float, help="a request at a sleeping stage waits this long for the "
                                                              "wake, else 503 (default 120)")
    p.add_argument("--profiler-dir", help="POST /start_profile, /stop_profile: torch.profiler traces of every rank "
                                          "into this folder")
    p.add_argument("--profiler-max-seconds", type=float, help="a profile stops by itself after this long (default 60)")
    p.add_argument("--offload", choices=["none", "model", "layerwise", "distributed"],
                   help="weight offload (docs/offload.md); distributed = DLO: 1/dp of the denoiser per rank")
    p.add_argument("--enable-distributed-layerwise-offload", dest="offload", action="store_const", const="distributed",
                   help="= --offload distributed: the data-parallel ranks shard the denoiser and all-gather each block")
    p.add_argument("--dlo-use-allgather", action=argparse.BooleanOptionalAction, default=None,
                   help="DLO: shards + all-gather (default); --no-dlo-use-allgather: each rank from its own disk copy")
    p.add_argument("--dlo-no-use-allgather", dest="dlo_use_allgather", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--decode-tile-side", type=int, help="the VAE decodes in tiles of at most this many pixels a side "
                                                        "(a video VAE's memory bound; default: whole frames)")


def config_from_args(args: argparse.Namespace, defaults: dict | None = None) -> StageConfig:
    """The stage config from ``--config`` (if given), ``defaults`` under it and the flags over it."""
    overrides: dict = {}
    for flag, (section, field) in ENGINE_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            (overrides.setdefault(section, {}) if section else overrides)[field] = value
    if getattr(args, "lora", None):
        overrides["loras"] = [parse_lora_flag(v) for v in args.lora]
    if getattr(args, "compile_shapes", None):
        overrides.setdefault("compile", {})["shapes"] = [v.strip() for v in args.compile_shapes.split(",") if v.strip()]
    for flag, field in (("quantization_components", "components"), ("quantization_skip", "skip")):
        if getattr(args, flag, None):
            overrides.setdefault("quantization", {})[field] = [v.strip() for v in getattr(args, flag).split(",")
                                                               if v.strip()]
    if getattr(args, "model", None):
        overrides["model"]["path"] = builtin_model(args.model)
    if args.config:
        return load_config_file(args.config, overrides, defaults)
    overrides = merge_overrides(defaults or {}, overrides)
    if "model" not in overrides:
        raise ConfigError("model.path: give --model DIR or --config stage.yaml")
    return load_config(overrides)


def builtin_model(model: str) -> str:
    """``--model``: a folder as given; a built-in tiny model's name (``tiny-digits``, as the CRD's ``builtin``) when no
    such folder exists: its folder (the shipped one, or built once under the system temp folder)."""
    if Path(model).exists() or not model.startswith("tiny-"):
        return model
    from stage_runtime.models.tiny import KINDS, builtin_folder

    folder = builtin_folder(model, Path(tempfile.gettempdir()) / f"diffstage-builtin-{os.getuid()}")
    if folder is None:
        raise ConfigError(f"--model={model!r}: no such folder, and no built-in model of that name (built-in: "
                          f"{', '.join(f'tiny-{k}' for k in KINDS)})")
    return str(folder)


def parse_size(size: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in size.lower().split("x"))
    except ValueError:
        raise InvalidRequestError("size", size, "must be WIDTHxHEIGHT, e.g. 64x64") from None
    return width, height


def cmd_validate(args: argparse.Namespace) -> int:
    # validate checks the topology; the model folder is not opened, so none need be given
    config = config_from_args(args, defaults={"model": {"path": "<unset>"}})
    p = config.parallel
    print(f"topology: {p.describe()}")
    print(f"executor: {config.resolved_executor}  execution_mode: {config.scheduler.execution_mode}  "
          f"max_num_seqs: {config.scheduler.max_num_seqs}")
    sc = config.scheduler
    print(f"scheduling_policy: {sc.scheduling_policy}  max_preemptions: {sc.max_preemptions}  "
          f"default_timeout_s: {sc.default_timeout_s}")
    if config.compile.enabled:
        c = config.compile
        print(f"compile: {c.mode}  shapes: {', '.join(c.shapes) or 'the default size'}  max_graphs: {c.max_graphs}  "
              f"timeout_s: {c.timeout_s:g}  cache_dir: {c.cache_dir or 'torch default'}")
    if config.quantization.enabled:
        q = config.quantization
        print(f"quantization: {q.method}  components: {', '.join(q.components) or 'the denoiser'}  skip: "
              f"{', '.join(q.skip) or 'norms, positional and patch embeddings, first and last projections'}"
              + (f"  file: {q.file}" if q.file else ""))
    if config.offload.mode != "none":
        o = config.offload
        print(f"offload: {o.mode}" + (f"  (DLO: all-gather over dp={p.dp_size}; waves of "
                                      f"{p.dp_size * sc.max_num_seqs} requests)" if o.dlo else "")
              + f"  components: {', '.join(o.components) or ('the denoiser' if o.mode == 'distributed' else 'all')}")
        if o.dlo:
            print("\n".join(describe_dlo(config.model.path, p.dp_size)))
    if config.sleep.enabled:
        sl = config.sleep
        print(f"sleep mode: level {sl.level}  after_idle_s: {sl.after_idle_s or 'never (POST /sleep only)'}  "
              f"drain_timeout_s: {sl.drain_timeout_s:g}  wake_timeout_s: {sl.wake_timeout_s:g}")
    if config.profiler.enabled:
        print(f"profiler: {config.profiler.dir}  max_seconds: {config.profiler.max_seconds:g}")
    for coords in p.rank_layout():
        print("  rank {0.rank}: tp={0.tp} sp={0.sp} pp={0.pp} cfg={0.cfg} dp={0.dp}".format(coords))
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from stage_runtime.models.tiny import make_tiny_model
    from stage_runtime.models.tiny.lora import write_demo_loras

    if args.all and args.gguf:
        raise ConfigError("make-tiny-model: --gguf writes one kind's denoiser; give --kind, not --all")
    kinds = TINY_KINDS if args.all else (args.kind,)
    for kind in kinds:
        t0 = time.perf_counter()
        out = Path(args.out_dir) / f"tiny-{kind}" if args.all else Path(args.out_dir)
        out = make_tiny_model(out, kind=kind, seed=args.seed)
        loras = [] if args.no_demo_loras else write_demo_loras(out)
        also = f" (demo LoRA adapters: {', '.join(str(p) for p in loras)})" if loras else ""
        if args.gguf:
            from stage_runtime.models.tiny.gguf_file import write_folder_gguf

            also += f" (GGUF denoiser: {write_folder_gguf(out, args.gguf)})"
        print(f"wrote tiny {kind} pipeline to {out} in {time.perf_counter() - t0:.2f} s{also}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.imageio import decode_image
    from stage_runtime.videoio import video_input_from_files

    config = config_from_args(args)
    sampling = {"num_inference_steps": args.steps, "seed": args.seed, "guidance_scale": args.guidance,
                "negative_prompt": args.negative_prompt, "true_cfg_scale": args.true_cfg_scale,
                "num_frames": args.frames, "fps": args.fps}
    if args.size:
        sampling["width"], sampling["height"] = parse_size(args.size)
    t0 = time.perf_counter()
    engine = DiffusionEngine.make_engine(config)
    t1 = time.perf_counter()
    try:
        video = engine.model_info.video
        out = Path(args.out or ("out.mp4" if video else "out.png"))
        if not video and (args.out or "").endswith(("/", ".mp4")):
            raise InvalidRequestError("out", args.out, f"{engine.model_info.pipeline_class} makes images: a .png file")
        reference = None if args.image is None else decode_image(Path(args.image).read_bytes(), "image", 1 << 26)
        video_input = video_input_from_files(args.video, args.mask_video, args.reference_image, 1 << 26)
        output = engine.generate(args.prompt, reference=reference, video_input=video_input,
                                 **{k: v for k, v in sampling.items() if v is not None})
        fps = args.fps or engine.model_info.default_fps
    finally:
        engine.close()
    t2 = time.perf_counter()
    sound = None if output.audio is None else output.audio.track(0)
    what = write_output(output.images[0], out, args.out, fps, sound)
    t3 = time.perf_counter()
    print(f"wrote {out.resolve()} ({what})")
    print(json.dumps({"engine_start_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 3),
                      "queue_ms": round(output.metrics["queue_ms"], 2), "exec_ms": round(output.metrics["exec_ms"], 2),
                      "save_s": round(t3 - t2, 3)}))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from stage_runtime.serve.termination import EXIT_CONFIG, termination_log_path, write_termination_log

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        write_termination_log(termination_log_path(args.termination_log), "ConfigError", str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from stage_runtime.executor.procs import start_fork_server

    start_fork_server(config.resolved_executor, config.worker_start_method)   # before torch is imported here
    from stage_runtime.serve.proc import serve

    return serve(config)


class StageArgumentParser(argparse.ArgumentParser):
    """A ``serve`` command line that does not parse is a configuration error like any other: exit 2 with
    the reason in the termination log (the operator shows it), not only on stderr."""

    serve_argv: list[str] | None = None           # set by main() while a serve command line is parsed

    def error(self, message: str):
        argv = StageArgumentParser.serve_argv
        if argv is not None:
            from stage_runtime.serve.termination import termination_log_path, write_termination_log

            path = next((a.split("=", 1)[1] for a in argv if a.startswith("--termination-log=")), None)
            if path is None and "--termination-log" in argv[:-1]:
                path = argv[argv.index("--termination-log") + 1]
            write_termination_log(termination_log_path(path), "ConfigError", f"invalid command line: {message}")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = StageArgumentParser(prog="stage-runtime", description="diffstage stage runtime")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=StageArgumentParser)
    srv = sub.add_parser("serve", help="serve the engine over HTTP and ZMQ (what each pod runs)")
    add_engine_flags(srv)
    add_serve_flags(srv)
    srv.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="generate one image through the engine")
    add_engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt")
    gen.add_argument("--steps", type=int)
    gen.add_argument("--size", help="WIDTHxHEIGHT")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--guidance", type=float)
    gen.add_argument("--true-cfg-scale", type=float, help="FLUX.1: true CFG with --negative-prompt (> 1: a "
                                                          "negative pass per step)")
    gen.add_argument("--frames", type=int, help="a video model's frame count (its rule, e.g. Wan 4k+1)")
    gen.add_argument("--fps", type=int, help="a video's frame rate (default: the model's)")
    gen.add_argument("--image", help="image-to-video: the picture the video starts from (PNG, JPEG, WebP…)")
    gen.add_argument("--video", help="video-to-video (Wan VACE): the source/control video (MP4, WebM…)")
    gen.add_argument("--mask-video", help="video-to-video: the mask video (white: generated, black: kept)")
    gen.add_argument("--reference-image", action="append", default=[], help="video-to-video: a reference picture")
    gen.add_argument("--out", help="a .png (image); a .mp4, or a folder ending in / for the exact PNG frames "
                                    "(video); default out.png / out.mp4")
    gen.set_defaults(func=cmd_generate)
    val = sub.add_parser("validate", help="validate a configuration and print its topology")
    add_engine_flags(val)
    val.set_defaults(func=cmd_validate)
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight diffusers pipeline")
    tiny.add_argument("out_dir")
    tiny.add_argument("--kind", choices=TINY_KINDS, default="sd")
    tiny.add_argument("--all", action="store_true",
                      help="every kind, each to OUT_DIR/tiny-<kind> (the runtime image's prebuilt models)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--no-demo-loras", action="store_true",
                      help="skip the random demo LoRA adapters written to OUT_DIR/loras/{ink,pixel} (LoRA families)")
    tiny.add_argument("--gguf", metavar="QUANT", choices=GGUF_QUANTS,
                      help="also write the denoiser as OUT_DIR/<denoiser>.QUANT.gguf, for quantization.method gguf "
                           f"({', '.join(GGUF_QUANTS)}; kinds flux and wan)")
    tiny.set_defaults(func=cmd_make_tiny_model)
    add_fetch_parser(sub)
    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    StageArgumentParser.serve_argv = argv if argv[:1] == ["serve"] else None
    try:
        args = build_parser().parse_args(argv)
    finally:
        StageArgumentParser.serve_argv = None
    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, InvalidRequestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
