"""Edits through the engine vs the bare diffusers edit pipeline, measured side by side in one process.

Each pair runs one img2img (and one inpaint) edit through a request-mode engine (uni executor) and the
same call on a bare ``StableDiffusionImg2ImgPipeline`` / ``StableDiffusionInpaintPipeline`` built from
the same folder, back to back with the order rotated. Prints the medians, min–max spread, the number of
pairs and the per-pair ratio engine / bare.

    .venv/bin/python bench/edits.py [--pairs 10] [--steps 20] [--strength 0.6] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from stats import machine, ratio_summary, spread  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strength", type=float, default=0.6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    from diffusers import DiffusionPipeline, StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline
    from PIL import Image

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model
    from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams

    torch.set_num_threads(args.threads)
    path = str(make_tiny_model(tempfile.mkdtemp(prefix="bench-edits-") + "/tiny-sd", kind="sd"))
    engine = DiffusionEngine.make_engine(load_config({"model": {"path": path}, "device": "cpu"}))
    components = DiffusionPipeline.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False).components
    bare = {"img2img": StableDiffusionImg2ImgPipeline(**components), "inpaint": StableDiffusionInpaintPipeline(**components)}
    for pipe in bare.values():
        pipe.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    print(f"machine: {machine()}")
    print(f"workload: tiny SD 64x64, {args.steps} steps, strength {args.strength} "
          f"({int(args.steps * args.strength)} denoising steps), {args.pairs} pairs, order rotated")
    try:
        for task in ("img2img", "inpaint"):
            task_mask = mask if task == "inpaint" else None
            eng_t, bare_t = [], []
            for i in range(args.pairs):
                def run_engine():
                    request = DiffusionRequest(f"{task}-{i}", "a cat", SamplingParams(
                        num_inference_steps=args.steps, seed=i), edit=EditInput(image, task_mask, args.strength))
                    engine.add_request(request).result(timeout=120)

                def run_bare():
                    kwargs = {} if task_mask is None else {"mask_image": Image.fromarray(task_mask, "L")}
                    bare[task](prompt="a cat", image=Image.fromarray(image), strength=args.strength,
                               num_inference_steps=args.steps, generator=torch.Generator().manual_seed(i),
                               output_type="np", **kwargs)

                for fn, out in ((run_engine, eng_t), (run_bare, bare_t))[:: 1 if i % 2 == 0 else -1]:
                    t0 = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - t0)
            print(f"{task}: engine {spread(eng_t)}; bare {spread(bare_t)}; engine/bare {ratio_summary(eng_t, bare_t)}")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
