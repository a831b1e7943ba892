"""A tiny StableDiffusion3Pipeline in the SD3.5 layout: two CLIP text encoders with projection + T5, a
2-block MMDiT (2 heads of 16, RMS q/k norm, the first block dual-attention, the last context-pre-only),
the tiny VAE, flow matching with SD3's static shift 3.

64x64 images: VAE factor 2 → 32x32x4 latents, patch 2 → 256 image tokens; text = 77 CLIP + 256 T5
tokens = 333, so the joint sequence is 589 tokens (Ulysses 2 splits the text unevenly, 167/166).
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import HIDDEN, LATENT_CHANNELS, seeded
from stage_runtime.models.tiny.flux import flow_match_scheduler, flow_vae
from stage_runtime.models.tiny.t5_tokenizer import T5_HIDDEN, build_t5_tokenizer, tiny_t5_encoder

HEADS, HEAD_DIM = 2, 16
PROJECTION = 32        # each CLIP's text projection; the pooled prompt is both, 64 wide


def _tiny_clip_with_projection(tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=tokenizer.model_max_length,
                            projection_dim=PROJECTION, hidden_act="gelu", pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return CLIPTextModelWithProjection(config)


def _tiny_sd3_transformer():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=T5_HIDDEN,
        caption_projection_dim=HEADS * HEAD_DIM,
        pooled_projection_dim=2 * PROJECTION,
        pos_embed_max_size=32,                  # up to 128x128 images
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )


def build(seed: int):
    from diffusers import StableDiffusion3Pipeline

    from stage_runtime.models.tiny.clip_tokenizer import build_clip_tokenizer

    t5 = build_t5_tokenizer()
    text = {"text_encoder_3": seeded(seed + 3, lambda: tiny_t5_encoder(t5)), "tokenizer_3": t5}
    for suffix, seed_offset in (("", 1), ("_2", 4)):          # two CLIP encoders with pooled projections
        clip = build_clip_tokenizer()
        text[f"text_encoder{suffix}"] = seeded(seed + seed_offset, lambda clip=clip: _tiny_clip_with_projection(clip))
        text[f"tokenizer{suffix}"] = clip
    return StableDiffusion3Pipeline(transformer=seeded(seed + 2, _tiny_sd3_transformer),
                                    scheduler=flow_match_scheduler(dynamic_shift=False), vae=seeded(seed, flow_vae),
                                    **text)
