"""A tiny Flux2KleinPipeline (FLUX.2 [klein] layout): a Qwen3 causal LM as text encoder (27 layers of hidden 16:
the pipeline stacks the hidden states of layers 9, 18 and 27, so the transformer's text width is 48), the tiny
Qwen2 BPE tokenizer with Qwen3's chat template (``enable_thinking=False`` writes the empty think block), and the
tiny FLUX.2 transformer WITHOUT a guidance embedding (Klein's base models run real CFG against the prompt ``""``),
the FLUX.2 VAE and scheduler of ``flux2``. ``is_distilled`` False: the step-distilled variants set it.

64x64 images: 256 image tokens of 16 channels; 512 prompt tokens.
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import seeded
from stage_runtime.models.tiny.flux2 import TEXT_HIDDEN, flux2_scheduler, tiny_flux2_transformer, tiny_flux2_vae

THINK = ("<think>", "</think>")
# Qwen3's ChatML with its thinking switch: with enable_thinking=False the assistant turn opens with an empty think
# block, as Flux2KleinPipeline asks for.
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")


def build_qwen3_tokenizer():
    """The tiny Qwen2 BPE tokenizer with Qwen3's think tokens and chat template."""
    from tokenizers import AddedToken

    from stage_runtime.models.tiny.qwen2_tokenizer import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tiny_text_encoder(tokenizer):
    """Qwen3ForCausalLM: 27 layers (hidden 16, 2 heads of 8, 1 kv head)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=32,
                         num_hidden_layers=27, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    return Qwen3ForCausalLM(config)


def build(seed: int, is_distilled: bool = False):
    from diffusers import Flux2KleinPipeline

    tokenizer = build_qwen3_tokenizer()
    return Flux2KleinPipeline(
        scheduler=flux2_scheduler(),
        vae=seeded(seed, tiny_flux2_vae),
        text_encoder=seeded(seed + 1, lambda: _tiny_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        transformer=seeded(seed + 2, lambda: tiny_flux2_transformer(guidance_embeds=False)),
        is_distilled=is_distilled,
    )
