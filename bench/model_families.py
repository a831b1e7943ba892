"""Per model family: engine vs bare diffusers pipeline, and request-batch-4 throughput vs sequential.

For every family in FAMILIES (a tiny model built locally) one process measures, interleaved and with the
order rotated every run:

    bare          the pipeline's own ``__call__`` for one request (per-image generator, seed)
    engine req    DiffusionEngine (uni executor), request mode, one request
    engine step   DiffusionEngine, step mode, one request (families with the step contract)
    seq x4        four requests one after another through the bare pipeline
    batch x4      the same four requests submitted at once to a request-mode engine with max_num_seqs=4
                  (one fused call; the denoiser-call count proves the fusion)

It prints per path the median and min–max in ms, per pair (engine / bare, seq / batch in the same run)
the median ratio and its min–max, the number of runs, and the largest |diff| between engine and bare
images (uint8). Add a family by adding a row to FAMILIES.

    .venv/bin/python bench/model_families.py [--runs 10] [--steps 8] [--size 64] [--threads 1] [--family sdxl]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stats import machine, max_uint8_diff, ratio_summary, rotated_round, spread  # noqa: E402


def _gens(seeds):
    import torch

    return [torch.Generator("cpu").manual_seed(s) for s in seeds]


def call_cfg(pipe, prompts, seeds, steps, size, guidance):
    """The pipeline's own guidance, no negative prompt (SDXL zeroes the unconditional embeddings; FLUX.1 and FLUX.2
    [dev] take guidance_scale as their guidance embedding; FLUX.2 [klein] guides against the prompt "")."""
    return pipe(prompt=prompts, height=size, width=size, num_inference_steps=steps, guidance_scale=guidance,
                generator=_gens(seeds), output_type="np").images


def call_cfg_empty_negative(pipe, prompts, seeds, steps, size, guidance):
    """SD-style CFG with an empty negative prompt (what the SD and generic adapters pass)."""
    return pipe(prompt=prompts, negative_prompt=[""] * len(prompts), height=size, width=size,
                num_inference_steps=steps, guidance_scale=guidance, generator=_gens(seeds), output_type="np").images


def call_true_cfg(pipe, prompts, seeds, steps, size, guidance):
    """Qwen-Image's true CFG: a negative pass (" ") at true_cfg_scale."""
    return pipe(prompt=prompts, negative_prompt=[" "] * len(prompts), true_cfg_scale=guidance, height=size,
                width=size, num_inference_steps=steps, generator=_gens(seeds), output_type="np").images


def picture(size: int, seed: int = 0):
    """The edit families' input picture: a smooth random RGB gradient at the output size (uint8)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([np.sin(6 * x + rng.uniform(0, 3)), np.cos(5 * y), x * y], -1)
    return ((base + 1) * 127).clip(0, 255).astype(np.uint8)


def call_edit(pipe, prompts, seeds, steps, size, guidance):
    """Qwen-Image-Edit(-Plus): an instruction edit of ``picture`` with true CFG against " " (the stage's default)."""
    from PIL import Image

    image = Image.fromarray(picture(size), "RGB")
    return pipe(image=image, prompt=prompts, negative_prompt=[" "] * len(prompts), true_cfg_scale=guidance,
                height=size, width=size, num_inference_steps=steps, generator=_gens(seeds), output_type="np").images


def build_pag(root: str) -> str:
    """StableDiffusionPAGPipeline from the tiny SD components: the generic adapter's family."""
    import diffusers

    from stage_runtime.models.tiny import make_tiny_model

    sd = diffusers.DiffusionPipeline.from_pretrained(make_tiny_model(f"{root}/sd", kind="sd"), local_files_only=True)
    parts = {k: v for k, v in sd.components.items() if k not in ("safety_checker", "feature_extractor")}
    diffusers.StableDiffusionPAGPipeline(**parts, safety_checker=None, feature_extractor=None,
                                         requires_safety_checker=False,
                                         pag_applied_layers=["mid"]).save_pretrained(f"{root}/pag")
    return f"{root}/pag"


@dataclass(frozen=True)
class Family:
    bare_call: Callable
    guidance: float
    kind: str | None = None                    # make_tiny_model kind; else ``build(root) -> path``
    build: Callable[[str], str] | None = None
    step_mode: bool = True
    edit: bool = False                         # requests carry ``picture`` (an instruction edit)


FAMILIES: dict[str, Family] = {
    "sd3": Family(call_cfg, 7.0, kind="sd3"),           # no negative prompt: SD3's default (None)
    "flux": Family(call_cfg, 3.5, kind="flux"),         # guidance-distilled: guidance_scale is the embedding
    "sdxl": Family(call_cfg, 5.0, kind="sdxl"),
    "qwen-image": Family(call_true_cfg, 4.0, kind="qwen-image"),
    "zimage": Family(call_cfg, 3.0, kind="zimage"),     # CFG at any scale > 0; its negative prompt defaults to ""
    "flux2": Family(call_cfg, 4.0, kind="flux2"),       # FLUX.2 [dev]: guidance-distilled, like FLUX.1
    "flux2-klein": Family(call_cfg, 4.0, kind="flux2-klein"),   # real CFG against "" (diffusers: two passes a step)
    "qwen-image-edit": Family(call_edit, 4.0, kind="qwen-image-edit", edit=True),
    "qwen-image-edit-plus": Family(call_edit, 4.0, kind="qwen-image-edit-plus", edit=True),
    "generic:StableDiffusionPAGPipeline": Family(call_cfg_empty_negative, 7.5, build=build_pag, step_mode=False),
}


def bench_family(name: str, family: Family, args, root: str) -> None:
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model

    path = family.build(root) if family.build else str(make_tiny_model(f"{root}/{family.kind}", kind=family.kind))
    extra = {}
    if family.edit:                 # transformers builds the folder's Qwen2-VL processor only with torchvision
        from stage_runtime.models.families.qwen_vl_processor import load_processor

        extra["processor"] = load_processor(path)
    bare = DiffusionPipeline.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False, **extra)
    bare.set_progress_bar_config(disable=True)

    def make(mode: str, seqs: int):
        return DiffusionEngine.make_engine(load_config({
            "model": {"path": path}, "device": "cpu", "executor": "uni", "warmup": False,
            "scheduler": {"execution_mode": mode, "max_num_seqs": seqs, "request_batch_max_wait_ms": 200.0}}))

    engines = {"req": make("request", 1), "batch": make("request", 4)}
    if family.step_mode:
        engines["step"] = make("step", 1)
    sampling = {"num_inference_steps": args.steps, "height": args.size, "width": args.size,
                "guidance_scale": family.guidance}
    calls = [0]
    engines["batch"].executor.worker.model_runner.adapter.denoiser.register_forward_pre_hook(
        lambda _m, _a: calls.__setitem__(0, calls[0] + 1))

    def to_u8(images):
        return (np.asarray(images) * 255).round().clip(0, 255).astype(np.uint8)

    def run_bare(prompt, seed):
        with torch.inference_mode():         # what the runner wraps its calls in
            return to_u8(family.bare_call(bare, [prompt], [seed], args.steps, args.size, family.guidance))

    from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

    edit = EditInput(picture(args.size)) if family.edit else None

    def request(rid, prompt, seed):
        return DiffusionRequest(rid, prompt, SamplingParams(seed=seed, **sampling), edit=edit)

    def run_engine(key):
        return lambda prompt, seed: engines[key].add_request(request(f"{key}{seed}", prompt, seed)).result(
            timeout=600).images

    def run_seq4(prompt, seed):
        return [run_bare(f"{prompt} {j}", seed + j) for j in range(4)]

    def run_batch4(prompt, seed):
        streams = [engines["batch"].add_request(request(f"b{seed}-{j}", f"{prompt} {j}", seed + j))
                   for j in range(4)]
        return [s.result(timeout=600).images for s in streams]

    paths = {"bare": run_bare, "engine req": run_engine("req")}
    if family.step_mode:
        paths["engine step"] = run_engine("step")
    paths.update({"seq x4": run_seq4, "batch x4": run_batch4})
    for i in range(2):
        for fn in paths.values():
            fn("warm", i)
    times: dict[str, list[float]] = {k: [] for k in paths}
    diff, calls[0] = 0, 0
    for i in range(args.runs):
        results = rotated_round(paths, i, times, f"a photo of object {i}", 1000 + 10 * i)
        pairs = [("engine req", "bare"), ("engine step", "bare"), ("batch x4", "seq x4")]
        diff = max_uint8_diff(results, pairs, diff)
    for engine in engines.values():
        engine.close()

    print(f"\n== {name} ({type(bare).__name__}), {args.size}x{args.size}, {args.steps} steps, guidance "
          f"{family.guidance:g}, {args.runs} runs per path, interleaved ==")
    for key, values in times.items():
        print(f"  {key:12s} {spread(values)}")
    for key in ("engine req", "engine step"):
        if key in times:
            print(f"  {key + ' / bare':20s} {ratio_summary(times[key], times['bare'])}")
    print(f"  {'seq x4 / batch x4':20s} {ratio_summary(times['seq x4'], times['batch x4'])}  "
          "(the throughput gain of one fused call: > 1 = batching wins)")
    print(f"  batch x4 denoiser calls per run: {calls[0] / args.runs:g} (= {args.steps} when the 4 requests fuse)")
    print(f"  images vs bare: max |diff| = {diff} (uint8)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--family", action="append", choices=list(FAMILIES), help="default: every family")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        for name in args.family or FAMILIES:
            bench_family(name, FAMILIES[name], args, root)
    print(f"\nran on: {machine()}; torch {torch.__version__} ({args.threads} thread)")


if __name__ == "__main__":
    main()
