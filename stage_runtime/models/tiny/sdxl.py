"""A tiny StableDiffusionXLPipeline: two CLIP text encoders (the second with a projection, giving the pooled
embedding), a 4-head UNet with SDXL's text-time micro-conditioning, the tiny VAE and Euler (as SDXL ships)."""

from __future__ import annotations

from stage_runtime.models.tiny.common import HIDDEN, NUM_HEADS, seeded, tiny_clip_text_encoder, tiny_unet, tiny_vae

TIME_EMBED_DIM = 8           # per micro-conditioning number: (orig h, orig w, crop top, crop left, target h, w)
PROJECTION_DIM = HIDDEN      # text_encoder_2's pooled projection


def _tiny_unet():
    """The tiny UNet with linear-projection transformers and the text_time embedding: cross-attention sees both
    encoders' hidden states concatenated (2 x 32); the added embedding takes the pooled text projection plus six
    micro-conditioning numbers of TIME_EMBED_DIM each."""
    return tiny_unet(cross_attention_dim=2 * HIDDEN, use_linear_projection=True, addition_embed_type="text_time",
                     addition_time_embed_dim=TIME_EMBED_DIM,
                     projection_class_embeddings_input_dim=6 * TIME_EMBED_DIM + PROJECTION_DIM)


def _tiny_text_encoder_2(tokenizer):
    """CLIPTextModelWithProjection (2 layers, 4 heads, hidden 32, projection 32): the pooled embedding."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=NUM_HEADS, max_position_embeddings=tokenizer.model_max_length,
        projection_dim=PROJECTION_DIM, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return CLIPTextModelWithProjection(config)


def euler_scheduler():
    """EulerDiscreteScheduler with SDXL's beta schedule and leading timestep spacing."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
        timestep_spacing="leading", interpolation_type="linear", use_karras_sigmas=False,
    )


def build(seed: int):
    from diffusers import StableDiffusionXLPipeline

    from stage_runtime.models.tiny.clip_tokenizer import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    return StableDiffusionXLPipeline(
        vae=seeded(seed, tiny_vae),
        text_encoder=seeded(seed + 1, lambda: tiny_clip_text_encoder(tokenizer)),
        text_encoder_2=seeded(seed + 3, lambda: _tiny_text_encoder_2(tokenizer)),
        tokenizer=tokenizer,
        tokenizer_2=build_clip_tokenizer(),
        unet=seeded(seed + 2, _tiny_unet),
        scheduler=euler_scheduler(),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
