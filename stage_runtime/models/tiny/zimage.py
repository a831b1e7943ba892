"""A tiny ZImagePipeline (Z-Image / Z-Image-Turbo layout): a single-stream DiT over the packed sequence
``[image tokens ‖ caption tokens]`` (each padded to a multiple of 32), a Qwen3 text encoder (2 layers, hidden 32;
the pipeline keeps its second-to-last hidden states, the prompt's own tokens only) with the tiny Qwen2 BPE
tokenizer and Qwen3's chat template, the tiny VAE with FLUX's latent scaling and shift, and Z-Image-Turbo's
flow-matching Euler scheduler (static shift 3).

64x64 images: VAE factor 2 → 32x32x4 latents → 2x2 patches → 256 image tokens; a prompt is ~10-20 tokens
(its chat template included), padded to 32. 4 heads of 16 (Ulysses 2 and 4 split them). The rotary tables
cover 1024 positions an axis (captions up to 512 tokens, then the image's; sides up to 4096 px).
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import LATENT_CHANNELS, NUM_HEADS, seeded

TEXT_HIDDEN = 32
DIM = 64                   # 4 heads x 16
AXES_DIMS = (4, 6, 6)      # the rotary split of a head (sums to 16)
NORM_WEIGHT = 3.0
# Qwen3's chat template, as far as ZImagePipeline uses it: one user message, the assistant's opening, and an
# empty thinking block when thinking is turned off (the pipeline asks with enable_thinking=True: none).
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                 "{% endif %}{% endif %}")


def _tiny_transformer():
    """ZImageTransformer2DModel: 1 noise + 1 context refiner layer, 2 main layers, 4 heads x 16, random pad
    tokens (diffusers starts them at zero: a pad token then would be no different from a zero input), and RMS norm
    weights of 3 (diffusers starts them at 1) on q and k and after attention and MLP: sharper attention and larger
    residual updates make the image depend on the prompt and the guidance (at 1 a prompt moves it by ~4 uint8)."""
    import torch
    from diffusers import ZImageTransformer2DModel

    model = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS, dim=DIM, n_layers=2,
        n_refiner_layers=1, n_heads=NUM_HEADS, n_kv_heads=NUM_HEADS, qk_norm=True, cap_feat_dim=TEXT_HIDDEN,
        axes_dims=list(AXES_DIMS), axes_lens=[1024, 1024, 1024])
    with torch.no_grad():
        model.x_pad_token.normal_()
        model.cap_pad_token.normal_()
        for layer in (*model.noise_refiner, *model.context_refiner, *model.layers):
            for norm in (layer.attention.norm_q, layer.attention.norm_k, layer.attention_norm2, layer.ffn_norm2):
                norm.weight.fill_(NORM_WEIGHT)
    return model


def _tiny_text_encoder(tokenizer):
    """Qwen3Model: 2 layers, hidden 32, 4 heads (2 kv heads) of 8."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(hidden_size=TEXT_HIDDEN, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=1024,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen3Model(config)


def build_tokenizer():
    """The tiny Qwen2 BPE with Qwen3's chat template and its thinking tags."""
    from tokenizers import AddedToken

    from stage_runtime.models.tiny.qwen2_tokenizer import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build(seed: int):
    from diffusers import ZImagePipeline

    from stage_runtime.models.tiny.common import flow_match_euler
    from stage_runtime.models.tiny.flux import flow_vae

    tokenizer = build_tokenizer()
    return ZImagePipeline(
        scheduler=flow_match_euler(3.0),
        vae=seeded(seed, flow_vae),
        text_encoder=seeded(seed + 1, lambda: _tiny_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        transformer=seeded(seed + 2, _tiny_transformer),
    )
