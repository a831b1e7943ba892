"""Edits through the engine vs the bare diffusers edit pipeline, measured side by side in one process.

Each pair runs one edit through a request-mode engine (uni executor) and the same call on the bare diffusers
edit pipeline loaded from the same folder, back to back with the order rotated. Prints the medians, min–max
spread, the number of pairs and the per-pair ratio engine / bare. Families and their edits:

    sd        img2img (StableDiffusionImg2ImgPipeline), inpaint (StableDiffusionInpaintPipeline)
    sdxl      img2img (StableDiffusionXLImg2ImgPipeline)
    flux      img2img (FluxImg2ImgPipeline)
    kontext   instruct (FluxKontextPipeline: no strength, every step)
    qwen-edit       instruct (QwenImageEditPipeline: true CFG, the picture at a megapixel)
    qwen-edit-plus  instruct (QwenImageEditPlusPipeline: two pictures)

    .venv/bin/python bench/edits.py [--family sd|sdxl|flux|kontext|qwen-edit|qwen-edit-plus] [--pairs 10]
        [--steps 20] [--strength 0.6]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from stats import machine, ratio_summary, spread  # noqa: E402

# family → (tiny kind, {task: diffusers edit pipeline class name})
FAMILIES = {
    "sd": ("sd", {"img2img": "StableDiffusionImg2ImgPipeline", "inpaint": "StableDiffusionInpaintPipeline"}),
    "sdxl": ("sdxl", {"img2img": "StableDiffusionXLImg2ImgPipeline"}),
    "flux": ("flux", {"img2img": "FluxImg2ImgPipeline"}),
    "kontext": ("flux-kontext", {"instruct": "FluxKontextPipeline"}),
    "qwen-edit": ("qwen-image-edit", {"instruct": "QwenImageEditPipeline"}),
    "qwen-edit-plus": ("qwen-image-edit-plus", {"instruct": "QwenImageEditPlusPipeline"}),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=sorted(FAMILIES), default="sd")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strength", type=float, default=0.6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import diffusers
    import torch
    from PIL import Image

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.families.qwen_vl_processor import load_processor
    from stage_runtime.models.tiny import make_tiny_model
    from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

    torch.set_num_threads(args.threads)
    kind, tasks = FAMILIES[args.family]
    path = str(make_tiny_model(tempfile.mkdtemp(prefix="bench-edits-") + f"/tiny-{kind}", kind=kind))
    engine = DiffusionEngine.make_engine(load_config({"model": {"path": path}, "device": "cpu"}))
    qwen = args.family.startswith("qwen")
    extra = {"add_watermarker": False} if args.family == "sdxl" else {"processor": load_processor(path)} if qwen else {}
    bare = {task: getattr(diffusers, name).from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False,
                                                            **extra) for task, name in tasks.items()}
    for pipe in bare.values():
        pipe.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    more = (np.ascontiguousarray(image[::-1]),) if args.family == "qwen-edit-plus" else ()
    strength = None if "instruct" in tasks else args.strength
    info = engine.model_info
    steps_run = EditInput(image, None, strength).resolve(info).denoise_steps(args.steps)
    print(f"machine: {machine()}")
    print(f"workload: tiny {kind} 64x64, {args.steps} steps, strength {strength} ({steps_run} denoising steps), "
          f"{args.pairs} pairs, order rotated")
    try:
        for task, pipe in bare.items():
            task_mask = mask if task == "inpaint" else None
            eng_t, bare_t = [], []
            for i in range(args.pairs):
                def run_engine():
                    request = DiffusionRequest(f"{task}-{i}", "a cat", SamplingParams(
                        num_inference_steps=args.steps, seed=i),
                        edit=EditInput(image, task_mask, strength, more_images=more))
                    engine.add_request(request).result(timeout=300)

                def run_bare():
                    kwargs = {"strength": args.strength}
                    if task_mask is not None or args.family == "flux":     # (they default to other sizes)
                        kwargs.update(height=64, width=64)
                    if task_mask is not None:
                        kwargs["mask_image"] = Image.fromarray(task_mask, "L")
                    if task == "instruct":
                        kwargs = {"height": 64, "width": 64, "max_area": 64 * 64, "_auto_resize": False}
                    kwargs["guidance_scale"] = info.default_guidance
                    pictures = [Image.fromarray(picture) for picture in (image, *more)]
                    if qwen:                                  # true CFG with the default negative prompt
                        kwargs = {"height": 64, "width": 64, "negative_prompt": " ",
                                  "true_cfg_scale": info.default_guidance}
                    pipe(prompt="a cat", image=pictures if more else pictures[0], num_inference_steps=args.steps,
                         generator=torch.Generator().manual_seed(i), output_type="np", **kwargs)

                for fn, out in ((run_engine, eng_t), (run_bare, bare_t))[:: 1 if i % 2 == 0 else -1]:
                    t0 = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - t0)
            print(f"{task}: engine {spread(eng_t)}; bare {spread(bare_t)}; engine/bare {ratio_summary(eng_t, bare_t)}")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
