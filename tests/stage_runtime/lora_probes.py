"""Random PEFT LoRA adapters for the tiny pipelines, written the way users get them: peft's LoraConfig on the
pipeline's own modules, then diffusers' ``save_lora_weights`` (the file format diffstage serves).

``bare_with_loras`` is the reference: a fresh pipeline, ``load_lora_weights`` + ``set_adapters``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from stage_runtime.config import ModelConfig
from stage_runtime.models.registry import resolve_adapter_class

WEIGHT_NAME, METADATA_KEY = "pytorch_lora_weights.safetensors", "lora_adapter_metadata"   # what diffusers writes
diffusers_logging.set_verbosity_error()
transformers_logging.set_verbosity_error()

SD_UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "conv1")        # conv1: the resnets' Conv2d
FLUX_TRANSFORMER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp")
CLIP_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
SD3_TRANSFORMER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj")
QWEN_TRANSFORMER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "img_mlp.net.0.proj")
# Wan: self- and cross-attention projections and the feed-forward's linears (what step-distillation LoRAs adapt)
WAN_TRANSFORMER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2")
# FLUX.2: double-stream attention and feed-forward, the single-stream blocks' fused q/k/v + MLP projection
FLUX2_TRANSFORMER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "linear_in", "to_qkv_mlp_proj")
# Z-Image: attention and SwiGLU feed-forward of the refiners and main layers, and the main layers' adaLN modulation
ZIMAGE_TRANSFORMER_TARGETS = (r".*(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123]"
                              r"|refiner\.\d+\.adaLN_modulation\.0|layers\.\d+\.adaLN_modulation\.0)")
DENOISER = {"StableDiffusionPipeline": ("unet", SD_UNET_TARGETS),
            "StableDiffusionXLPipeline": ("unet", SD_UNET_TARGETS),
            "QwenImagePipeline": ("transformer", QWEN_TRANSFORMER_TARGETS),
            "QwenImageEditPipeline": ("transformer", QWEN_TRANSFORMER_TARGETS),
            "QwenImageEditPlusPipeline": ("transformer", QWEN_TRANSFORMER_TARGETS),
            "FluxPipeline": ("transformer", FLUX_TRANSFORMER_TARGETS),
            "FluxKontextPipeline": ("transformer", FLUX_TRANSFORMER_TARGETS),
            "StableDiffusion3Pipeline": ("transformer", SD3_TRANSFORMER_TARGETS),
            "Flux2Pipeline": ("transformer", FLUX2_TRANSFORMER_TARGETS),
            "Flux2KleinPipeline": ("transformer", FLUX2_TRANSFORMER_TARGETS),
            "ZImagePipeline": ("transformer", ZIMAGE_TRANSFORMER_TARGETS),
            "WanPipeline": ("transformer", WAN_TRANSFORMER_TARGETS),
            "WanImageToVideoPipeline": ("transformer", WAN_TRANSFORMER_TARGETS),
            "WanVACEPipeline": ("transformer", WAN_TRANSFORMER_TARGETS)}     # its VACE blocks match too


def load_pipe(model_path: str):
    """The folder as diffusers loads it, materialised as the family's adapter loads it (Wan: diffusers' choice)."""
    low_cpu_mem_usage = resolve_adapter_class(ModelConfig(path=model_path)).low_cpu_mem_usage
    extra = {}
    if (Path(model_path) / "processor").is_dir():   # Qwen-Image-Edit: transformers builds its processor only with
        from stage_runtime.models.families.qwen_vl_processor import load_processor      # torchvision; the stage's own

        extra["processor"] = load_processor(model_path)
    pipe = DiffusionPipeline.from_pretrained(model_path, local_files_only=True, low_cpu_mem_usage=low_cpu_mem_usage,
                                             **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def random_adapter(model_path: str, seed: int, rank: int = 4, alpha: float = 8.0, text_encoder: bool = True,
                   gain: float = 0.3, expert: str | None = None, targets: dict[str, object] | None = None):
    """A random PEFT adapter (B ≠ 0: init_lora_weights=False, scaled by ``gain`` to stay in range) on the
    pipeline's own modules → (pipeline class, {component: PEFT state dict}, {component: its LoraConfig as a dict}).
    ``targets``: component → PEFT ``target_modules`` (a suffix list or a regex), instead of the family's."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    pipe = load_pipe(model_path)
    denoiser_name, denoiser_targets = DENOISER[type(pipe).__name__]
    parts = {denoiser_name: (getattr(pipe, expert or denoiser_name), denoiser_targets)}
    if text_encoder:              # the CLIP encoders diffusers' loader adapts (SD3, SDXL: both; Qwen-Image: none)
        for name in ("text_encoder", "text_encoder_2"):
            if name in type(pipe)._lora_loadable_modules:
                parts[name] = (getattr(pipe, name), CLIP_TARGETS)
    if targets is not None:
        parts = {name: (parts[name][0], target) for name, target in targets.items()}
    layers, configs = {}, {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, (module, target) in parts.items():
            config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False,
                                target_modules=target if isinstance(target, str) else list(target))
            inject_adapter_in_model(config, module)       # (transformers' add_adapter wants peft >= 0.22)
            layers[name] = {k: v * gain for k, v in get_peft_model_state_dict(module).items()}
            configs[name] = config.to_dict()
    return type(pipe), layers, configs


def write_adapter(model_path: str, out_dir: Path, seed: int, rank: int = 4, alpha: float = 8.0,
                  text_encoder: bool = True, gain: float = 0.3, expert: str | None = None) -> str:
    """``random_adapter`` saved by diffusers' ``save_lora_weights`` (PEFT keys and the adapter metadata) → its
    folder. ``expert="transformer_2"``: made on Wan 2.2's second expert, saved as diffusers saves every Wan LoRA
    (keys ``transformer.…``: what ``load_lora_weights(..., load_into_transformer_2=True)`` takes)."""
    cls, layers, configs = random_adapter(model_path, seed, rank, alpha, text_encoder, gain, expert)
    cls.save_lora_weights(str(out_dir), **{f"{name}_lora_layers": state for name, state in layers.items()},
                          **{f"{name}_lora_adapter_metadata": config for name, config in configs.items()})
    return str(out_dir)


def two_expert_file(high_dir: str, low_dir: str, out_dir: Path) -> str:
    """One Wan 2.2 adapter file for both experts from a pair as diffusers saves them (both ``transformer.…``): the
    high-noise file's keys as they are, the low-noise file's as ``transformer_2.…`` (and its metadata likewise)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors, packed = {}, {}
    for folder, component in ((high_dir, "transformer"), (low_dir, "transformer_2")):
        with safe_open(str(Path(folder) / WEIGHT_NAME), framework="pt") as f:
            tensors.update({component + k[len("transformer"):]: f.get_tensor(k) for k in f.keys()})
            meta = json.loads((f.metadata() or {}).get(METADATA_KEY, "{}"))
        packed.update({component + k[len("transformer"):]: v for k, v in meta.items()})
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHT_NAME), metadata={METADATA_KEY: json.dumps(packed), "format": "pt"})
    return str(out_dir)


def bare_with_loras(model_path: str, adapters: dict[str, str], weights: list[float] | None, prompt: str,
                    steps: int, seed: int, size: int = 64, n: int = 1, into_transformer_2: tuple[str, ...] = (),
                    **kw) -> np.ndarray:
    """The bare diffusers call with ``load_lora_weights`` + ``set_adapters(names, weights)`` (no adapters: base);
    the adapters named in ``into_transformer_2`` loaded with ``load_into_transformer_2=True`` (Wan 2.2)."""
    pipe = load_pipe(model_path)
    for name, path in adapters.items():
        pipe.load_lora_weights(path, adapter_name=name, **({"load_into_transformer_2": True}
                                                             if name in into_transformer_2 else {}))
    if adapters:
        pipe.set_adapters(list(adapters), weights)
    gens = [torch.Generator("cpu").manual_seed(seed + i) for i in range(n)]
    out = pipe(prompt=[prompt] * n, height=size, width=size, num_inference_steps=steps, generator=gens,
               output_type="np", **kw)
    images = out.frames if hasattr(out, "frames") else out.images
    return (images * 255).round().clip(0, 255).astype(np.uint8)


def original_layout_file(path: str, out: Path, seed: int, biases: bool = False,
                         name: str = "original.safetensors") -> Path:
    """A random Wan LoRA in the layout its authors publish (lightx2v, CausVid): ``diffusion_model.blocks.N.self_attn.q``
    …, kohya-style ``lora_down`` / ``lora_up`` with an ``alpha`` per module; ``biases``: also each module's bias
    difference (``diff_b``) and the norms' zeroed ``diff`` keys, as CausVid and the lightx2v step-distill files carry."""
    from safetensors.torch import save_file

    transformer = load_pipe(path).transformer
    generator, tensors = torch.Generator().manual_seed(seed), {}
    for i in range(len(transformer.blocks)):
        for module in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.o",
                       "ffn.0", "ffn.2"):
            key = f"diffusion_model.blocks.{i}.{module}"
            width = 32
            tensors[f"{key}.lora_down.weight"] = torch.randn(4, width, generator=generator) / width ** 0.5
            tensors[f"{key}.lora_up.weight"] = torch.randn(width, 4, generator=generator)
            tensors[f"{key}.alpha"] = torch.tensor(2.0)
            if biases:
                tensors[f"{key}.diff_b"] = torch.randn(width, generator=generator) * 0.5
        if biases:
            for norm in ("self_attn.norm_q", "self_attn.norm_k", "cross_attn.norm_q", "cross_attn.norm_k"):
                tensors[f"diffusion_model.blocks.{i}.{norm}.diff"] = torch.zeros(32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / name))
    return out / name
