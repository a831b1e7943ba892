"""Part 3's models: published denoiser and VAE sizes with random weights, built on the device (no download).

    flux   FLUX.1-dev's transformer (19 double + 38 single blocks, 24 heads of 128; ~11.9 B parameters) and VAE
           (16 latent channels), 1024 x 1024, bfloat16
    wan    Wan 2.1 T2V 1.3B's transformer (30 blocks, 12 heads of 128, FFN 8960) and its 3D VAE, 480 x 832 x 81 frames,
           bfloat16
    sdxl   SDXL's UNet (320/640/1280 channels, 1/2/10 transformer layers; ~2.6 B parameters) and VAE, 1024 x 1024,
           float16 (its VAE upcasts itself)

The text encoders are the tiny models' with their real widths (CLIP 768, CLIP-G 1280, T5/UMT5 4096) and ONE
layer: the denoiser sees inputs of its real shapes (512 T5 tokens for FLUX and Wan), while the encoders' cost —
a few percent of a request on these models — is not what is measured. Weights are drawn on the device in its
dtype (seconds, where building 12 B parameters on the CPU would take minutes); the toy sizes of the dry run are
the tiny models' own configs, built the same way.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass, field

FLUX = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
        "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
        "axes_dims_rope": (16, 56, 56)}
FLUX_VAE = {"in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
            "up_block_types": ("UpDecoderBlock2D",) * 4, "block_out_channels": (128, 256, 512, 512),
            "layers_per_block": 2, "latent_channels": 16, "norm_num_groups": 32, "sample_size": 1024,
            "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False}
WAN = {"patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
       "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
       "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
WAN_VAE: dict = {}                                   # AutoencoderKLWan's defaults are Wan 2.1's VAE
SDXL = {"sample_size": 128, "in_channels": 4, "out_channels": 4,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        "block_out_channels": (320, 640, 1280), "layers_per_block": 2, "transformer_layers_per_block": (1, 2, 10),
        "attention_head_dim": (5, 10, 20), "cross_attention_dim": 2048, "use_linear_projection": True,
        "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816, "norm_num_groups": 32}
SDXL_VAE = {**FLUX_VAE, "latent_channels": 4, "scaling_factor": 0.13025, "shift_factor": None,
            "use_quant_conv": True, "use_post_quant_conv": True, "force_upcast": True}
# one-layer text encoders at their real widths: (component, config overrides)
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 1}
CLIP_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20, "num_hidden_layers": 1,
          "projection_dim": 1280}
T5 = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_heads": 64, "num_layers": 1}


@dataclass(frozen=True)
class Model:
    name: str
    tiny_kind: str                    # the tiny builder whose tokenizers, scheduler and (toy) configs are used
    denoiser: str                     # the pipeline component
    denoiser_class: str
    denoiser_config: dict
    vae_class: str
    vae_config: dict
    encoders: dict = field(default_factory=dict)     # component → real-width overrides
    shape: dict = field(default_factory=dict)        # the request's height, width (num_frames)
    toy_shape: dict = field(default_factory=dict)
    dtype: str = "bfloat16"
    guidance: float = 5.0
    adapter: str = ""                 # the prebuilt adapter (gpucheck.prebuilt) serving it
    published: str = ""               # what the sizes are


MODELS = {
    "flux": Model("flux", "flux", "transformer", "FluxTransformer2DModel", FLUX, "AutoencoderKL", FLUX_VAE,
                  {"text_encoder": CLIP_L, "text_encoder_2": T5}, {"height": 1024, "width": 1024},
                  {"height": 64, "width": 64}, "bfloat16", 3.5, "gpucheck.prebuilt:Flux",
                  "FLUX.1-dev transformer + VAE, 1024x1024"),
    "wan": Model("wan", "wan", "transformer", "WanTransformer3DModel", WAN, "AutoencoderKLWan", WAN_VAE,
                 {"text_encoder": T5}, {"height": 480, "width": 832, "num_frames": 81},
                 {"height": 32, "width": 32, "num_frames": 9}, "bfloat16", 5.0, "gpucheck.prebuilt:Wan",
                 "Wan 2.1 T2V 1.3B transformer + VAE, 480x832x81"),
    "sdxl": Model("sdxl", "sdxl", "unet", "UNet2DConditionModel", SDXL, "AutoencoderKL", SDXL_VAE,
                  {"text_encoder": CLIP_L, "text_encoder_2": CLIP_G}, {"height": 1024, "width": 1024},
                  {"height": 64, "width": 64}, "float16", 5.0, "gpucheck.prebuilt:SDXL", "SDXL UNet + VAE, 1024x1024"),
}


def on_device(cls, config: dict, device, dtype, seed: int):
    """``cls(**config)`` with its weights drawn on ``device`` in ``dtype`` (seeded)."""
    import torch

    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = cls(**config) if isinstance(config, dict) else cls(config)
    finally:
        torch.set_default_dtype(previous)
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    if keep and dtype != torch.float32:                   # as from_pretrained(dtype=...) loads them (Wan's norms)
        for name, param in module.named_parameters():
            if any(part in keep for part in name.split(".")):
                param.data = param.data.float()
    return module.eval()


def widened(encoder, overrides: dict):
    """The tiny encoder's config at the real widths (one layer), as a config object of its class."""
    config = copy.deepcopy(encoder.config)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build(name: str, target, seed: int = 0):
    """The pipeline of ``MODELS[name]`` on the target's device: real sizes, or the tiny configs in the dry run."""
    import diffusers
    import torch

    from stage_runtime.models.adapter import DTYPES

    spec = MODELS[name]
    tiny = importlib.import_module(f"stage_runtime.models.tiny.{spec.tiny_kind}").build(seed)
    device, dtype = target.torch_device, DTYPES[target.dtype(spec.dtype)]
    real = target.sizes == "real"
    parts = dict(tiny.components)
    denoiser_config = spec.denoiser_config if real else public(getattr(tiny, spec.denoiser).config)
    vae_config = spec.vae_config if real else public(tiny.vae.config)
    parts[spec.denoiser] = on_device(getattr(diffusers, spec.denoiser_class), denoiser_config, device, dtype, seed + 1)
    parts["vae"] = on_device(getattr(diffusers, spec.vae_class), vae_config, device, dtype, seed + 2)
    for component, overrides in spec.encoders.items():
        encoder = parts[component]
        parts[component] = on_device(type(encoder), widened(encoder, overrides) if real else encoder.config, device,
                                     dtype, seed + 3)
    for component, module in parts.items():           # the tokenizers stay; the rest (schedulers: no-op) to the device
        if isinstance(module, torch.nn.Module):
            parts[component] = module.to(device)
    # a new pipeline of the same class: its __init__ derives the VAE scale factor and image processors from the VAE
    accepted = inspect.signature(type(tiny).__init__).parameters
    flags = {k: tiny.config[k] for k in accepted if k not in parts and k in tiny.config}
    pipe = type(tiny)(**{k: v for k, v in parts.items() if k in accepted}, **flags)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def public(config: dict) -> dict:
    """A diffusers config without its private keys (``_class_name``, ``_diffusers_version``, …)."""
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())
