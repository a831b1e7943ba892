"""Parts the tiny builders share: seeded construction, the tiny UNet and VAE, DDIM and flow schedulers, a tiny
CLIP text encoder.

Sizes: 64x64 images by default (VAE downsample 2, 32x32 latents with 4 channels); every attention
layer has 4 heads so sequence-parallel schemes that split heads 2- or 4-ways work.
"""

from __future__ import annotations

HIDDEN = 32  # text hidden size == UNet cross-attention dim == DiT inner dim (4 heads x 8)
NUM_HEADS = 4
LATENT_CHANNELS = 4
NUM_CLASSES = 1000  # DiTPipeline uses class id 1000 as the "null" class for guidance


def seeded(seed: int, build):
    """Call ``build()`` with torch's global RNG seeded to ``seed`` (restored afterwards)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def tiny_unet(**config):
    """UNet2DConditionModel on 32x32 latents with 4-head (self and cross) attention; ``config`` adds to or
    overrides the SD-1.x layout (SDXL: two encoders' width, linear projections, text-time embedding).

    Channels are 16/32; attention only lives at the 32-channel level (down, mid, up), so every attention layer
    has 4 heads of dim 8, like the text encoder and DiT. In ``UNet2DConditionModel`` ``attention_head_dim`` is
    historically the *number of heads* (diffusers issue #2011), so 4 here means 4 heads per layer.
    """
    from diffusers import UNet2DConditionModel

    layout = {"sample_size": 32, "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS,
              "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
              "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "block_out_channels": (16, 32),
              "layers_per_block": 1, "norm_num_groups": 8, "cross_attention_dim": HIDDEN,
              "attention_head_dim": NUM_HEADS}
    return UNet2DConditionModel(**{**layout, **config})


def tiny_vae():
    """AutoencoderKL with two 16/32-channel levels: 2x downsampling, 4 latent channels.

    (32/64 channels would alone exceed the ~2 MB on-disk budget in float32.)
    """
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=64,
    )


def ddim_scheduler():
    """DDIM scheduler with the standard Stable Diffusion beta schedule."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def tiny_clip_text_encoder(tokenizer):
    """CLIPTextModel (2 layers, 4 heads, hidden 32) whose ids match ``tokenizer``."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=NUM_HEADS,
        max_position_embeddings=tokenizer.model_max_length,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return CLIPTextModel(config)


def flow_match_euler(shift: float, **config):
    """FlowMatchEulerDiscreteScheduler with a static ``shift`` (``config`` may turn on a dynamic one)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=shift, **config)


def unipc_flow(flow_shift: float):
    """UniPCMultistepScheduler on flow sigmas (what real Wan checkpoints ship): a multistep solver, so it keeps
    the last model outputs between steps (state a step-level runner must keep per request)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift)
