"""A tiny QwenImagePipeline: a 2-layer dual-stream MMDiT (4 heads of 16), a tiny Qwen2.5-VL text encoder
(2 layers, hidden 32, the tiny Qwen2 BPE tokenizer), the tiny Qwen-Image VAE, flow-matching Euler with
Qwen-Image's dynamic shift."""

from __future__ import annotations

from stage_runtime.models.tiny.common import NUM_HEADS, seeded

TEXT_HIDDEN = 32
Z_DIM = 4


def _tiny_transformer():
    """QwenImageTransformer2DModel: packed 2x2 latent patches (16 channels in), 2 blocks, 4 heads x 16."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=2, attention_head_dim=16,
        num_attention_heads=NUM_HEADS, joint_attention_dim=TEXT_HIDDEN, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )


def _tiny_vae():
    """AutoencoderKLQwenImage (causal 3D VAE, 4x spatial downsampling) with non-trivial latent statistics."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.1, -0.1, 0.05, 0.0], latents_std=[0.9, 1.1, 1.0, 1.2],
    )


def _tiny_text_encoder(tokenizer):
    """Qwen2_5_VLForConditionalGeneration: 2 text layers (hidden 32, 4 heads, 2 kv heads), a 1-layer vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": TEXT_HIDDEN, "intermediate_size": 37, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": len(tokenizer),
                     "max_position_embeddings": 2048, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": TEXT_HIDDEN},
        vocab_size=len(tokenizer), image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        vision_token_id=ids("<|vision_pad|>"), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def flow_match_scheduler():
    """FlowMatchEulerDiscreteScheduler configured as Qwen-Image ships it (exponential dynamic shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )


def build(seed: int):
    from diffusers import QwenImagePipeline

    from stage_runtime.models.tiny.qwen2_tokenizer import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    return QwenImagePipeline(
        scheduler=flow_match_scheduler(),
        vae=seeded(seed, _tiny_vae),
        text_encoder=seeded(seed + 1, lambda: _tiny_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        transformer=seeded(seed + 2, _tiny_transformer),
    )
