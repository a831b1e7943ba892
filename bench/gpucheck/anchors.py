"""Published numbers part 3's figures are printed next to (docs/testing.md, "The GPU check", lists the same).

Each anchor names its hardware, workload and source, as found in the project's research notes; none is ours.
They are context, not targets: random weights, few steps and one request at a time make our
figures comparable in shape (per-step time, batching gain, overhead ratio), not a benchmark result.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Anchor:
    topic: str            # what our figure it goes with measures
    figure: str           # the published number
    setup: str            # hardware and workload
    source: str

    def line(self) -> str:
        return f"{self.figure} ({self.setup}; {self.source})"


ANCHORS = (
    Anchor("flux step", "diffusers SDPA 5.58 s per image (~199 ms a step if 28 steps); SGLang's best 2.38 s",
           "FLUX.1-dev, 1x H200; steps and size not in our notes (its defaults: 28, 1024x1024)", "SGLang PR #19673"),
    Anchor("wan step", "47.8 s per video (~956 ms a step), 26.7 s on 2 GPUs with FSDP + CFG",
           "Wan 2.1 1.3B 832x480x81, 50 steps, 1 GPU (model not stated)", "SGLang deployment_cookbook.md"),
    Anchor("sdxl step", "bf16 + SDPA 3.31 s per image (~110 ms a step)", "SDXL 1024x1024, 30 steps, 1x A100-80GB",
           "diffusers fast_diffusion tutorial"),
    Anchor("batching", "batch 2 / 4: 1.82x / 2.77x at 512x512; 1.02x for batch 2 at 1024x1024",
           "Qwen-Image-2512, 50 steps, torch.compile, 1x H200", "SGLang PR #22183"),
    Anchor("batching", "batch 2 / 4: 1.14x / 1.22x", "Qwen-Image 512x512, 10 steps", "vLLM-Omni PR #1593"),
    Anchor("overhead", "CI fails a server more than 20% slower than direct diffusers (a regression measured 37%)",
           "Qwen-Image, 1x H100", "vLLM-Omni issue #5108"),
    Anchor("compile", "6.71 s -> 4.30 s per image with torch.compile (1.56x)", "FLUX.1-dev 1024x1024, 28 steps, "
           "1x H100", "xDiT docs/performance/flux.md"),
    Anchor("compile", "LTX-2.3 warm-up 42.2 s -> 24.2 s with regional compile, denoise 1.81x", "1x H100",
           "sgl-project/sglang#32696"),
    Anchor("quantization", "FP8: Z-Image 19.15 -> 13.40 GiB, 1.32x faster, LPIPS 0.038; Qwen-Image 53.75 -> 41.20 GiB, "
           "1.30x, LPIPS 0.298", "vLLM-Omni, per family", "vLLM-Omni quantization docs (issue 45's figures)"),
    Anchor("offload", "denoise 312.8 s of 322 s with layerwise offload; component offload lowered memory, not "
           "latency", "Wan 2.1 1.3B 81 frames, 50 steps, 8x H200", "SGLang disaggregation.md, deployment_cookbook.md"),
)


def anchors(topic: str) -> list[Anchor]:
    return [a for a in ANCHORS if a.topic == topic]


def text(topic: str) -> str:
    """Every anchor of ``topic`` on one line (empty when there is none)."""
    return " | ".join(a.line() for a in anchors(topic))
