"""Step-distilled Wan LoRAs (CausVid / lightx2v) as served: 4 steps at guidance 1 with the LoRA vs the 40-step default
at guidance 5, same size, same engine, wall time per video.

The LoRA files are random, in the published layouts (``diffusion_model.blocks.N.self_attn.q.lora_down`` + ``alpha`` +
``diff_b``; Wan 2.2: a folder with ``high_noise_model.safetensors`` and ``low_noise_model.safetensors``), so the
videos mean nothing: this measures what the recipe costs in time (steps, guidance rows, the unfused LoRA's extra
matmuls), not its quality. Tiny Wan 2.1 and Wan 2.2 A14B (two experts) built here, request mode, one video at a
time, the two arms interleaved with the order rotated each run.

    .venv/bin/python bench/distill.py [--runs 3] [--size 32] [--frames 17] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

from stats import machine, ratio_summary, spread  # noqa: E402

ARMS = {"default": {"steps": 40, "guidance": 5.0, "lora": None}, "distill": {"steps": 4, "guidance": 1.0,
                                                                             "lora": "distill"}}


def published_file(transformer, out: Path, name: str, seed: int) -> Path:
    """A random LoRA over every block's attention and feed-forward linears, in the published key layout."""
    import torch
    from safetensors.torch import save_file

    generator, tensors = torch.Generator().manual_seed(seed), {}
    for i, block in enumerate(transformer.blocks):
        for ours, theirs in (("attn1.to_q", "self_attn.q"), ("attn1.to_k", "self_attn.k"), ("attn1.to_v", "self_attn.v"),
                             ("attn1.to_out.0", "self_attn.o"), ("attn2.to_q", "cross_attn.q"),
                             ("attn2.to_k", "cross_attn.k"), ("attn2.to_v", "cross_attn.v"),
                             ("attn2.to_out.0", "cross_attn.o"), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2")):
            layer = block.get_submodule(ours)
            key = f"diffusion_model.blocks.{i}.{theirs}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(4, layer.in_features, generator=generator) * 0.01
            tensors[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, 4, generator=generator) * 0.01
            tensors[f"{key}.alpha"] = torch.tensor(4.0)
            tensors[f"{key}.diff_b"] = torch.randn(layer.out_features, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / name))
    return out / name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    from diffusers import DiffusionPipeline

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model
    from stage_runtime.request import DiffusionRequest, SamplingParams

    torch.set_num_threads(args.threads)
    print(f"distill bench: {machine()}, {args.threads} torch thread(s), {args.size}x{args.size}x{args.frames}, "
          f"request mode, {args.runs} runs")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("wan", "wan22"):
            path = str(make_tiny_model(Path(tmp) / kind, kind=kind))
            pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
            if kind == "wan":
                lora = published_file(pipe.transformer, Path(tmp) / "lora-wan", "distill.safetensors", 1)
            else:
                lora = Path(tmp) / "lora-wan22"
                published_file(pipe.transformer, lora, "high_noise_model.safetensors", 2)
                published_file(pipe.transformer_2, lora, "low_noise_model.safetensors", 3)
            engine = DiffusionEngine.make_engine(load_config({
                "model": {"path": path}, "device": "cpu", "executor": "uni", "warmup": False,
                "loras": [{"name": "distill", "path": str(lora)}]}))
            seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
            try:
                names = list(ARMS)
                for run in range(args.runs + 1):                      # run 0 warms both arms, not counted
                    for arm in names[run % 2:] + names[:run % 2]:
                        spec = ARMS[arm]
                        loras = [{"name": spec["lora"], "scale": 1.0}] if spec["lora"] else []
                        request = DiffusionRequest(f"{arm}-{run}", "a red fox running", SamplingParams(
                            num_inference_steps=spec["steps"], guidance_scale=spec["guidance"], seed=run,
                            height=args.size, width=args.size, num_frames=args.frames, loras=loras), video=True)
                        t0 = time.perf_counter()
                        assert engine.add_request(request).result(timeout=1200).ok
                        if run:
                            seconds[arm].append(time.perf_counter() - t0)
            finally:
                engine.close()
            print(f"\ntiny-{kind}:")
            for arm, spec in ARMS.items():
                print(f"  {arm:<8} {spec['steps']:>2} steps, guidance {spec['guidance']:<3}: "
                      f"{spread(seconds[arm], unit='s', scale=1.0)}")
            print(f"  distill / default: {ratio_summary(seconds['distill'], seconds['default'])}")


if __name__ == "__main__":
    main()
