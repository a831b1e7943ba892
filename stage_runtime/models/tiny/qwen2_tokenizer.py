"""A tiny byte-level BPE ``Qwen2Tokenizer`` built in code (no download).

The vocabulary is GPT-2/Qwen-style byte-level BPE: the 256 byte characters (space is ``Ġ``, newline
``Ċ``), merged whole-word tokens for a short word list, then Qwen's chat special tokens. The words of
QwenImagePipeline's prompt template are in the list, so its system prefix encodes to exactly the 34
tokens the pipeline drops (``prompt_template_encode_start_idx``), as with the real Qwen2 vocabulary; a
builder whose template has other words passes them as ``extra_words`` (runs of spaces too: give the shorter
runs first, " " then "   ", so that each run's merges stay whole under BPE). The tokenizer carries Qwen2's
ChatML chat template (``apply_chat_template``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from stage_runtime.models.tiny.clip_tokenizer import COMMON_WORDS, add_whole_word, bytes_to_unicode

if TYPE_CHECKING:  # pragma: no cover
    from transformers import Qwen2Tokenizer

ENDOFTEXT = "<|endoftext|>"
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<|video_pad|>")
TEMPLATE_WORDS = ("system user assistant Describe the image by detailing color shape size texture quantity text "
                  "spatial relationships of objects and background").split()
MODEL_MAX_LENGTH = 32768
# Qwen2's ChatML format: each message as <|im_start|>role, newline, content, <|im_end|>, newline; then the
# assistant's opening when a generation prompt is asked for.
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_level(text: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def build_vocab_and_merges(extra_words: Sequence[str] = ()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges): byte characters, then each word (bare and space-prefixed) merged into one token."""
    tokens = list(bytes_to_unicode().values())
    ranks: dict[tuple[str, str], int] = {}
    words = dict.fromkeys([*TEMPLATE_WORDS, *COMMON_WORDS, *extra_words])
    for word in (form for w in words for form in (w, " " + w)):
        add_whole_word(list(_byte_level(word)), ranks, tokens)
    vocab: dict[str, int] = {}
    for token in [*tokens, ENDOFTEXT, *SPECIALS]:
        vocab.setdefault(token, len(vocab))
    return vocab, list(ranks)


def build_qwen2_tokenizer(extra_words: Sequence[str] = ()) -> "Qwen2Tokenizer":
    """A small ``Qwen2Tokenizer`` (pad = eos = unk = ``<|endoftext|>``; chat specials as special tokens)."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = build_vocab_and_merges(extra_words)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=MODEL_MAX_LENGTH,
                               chat_template=CHAT_TEMPLATE)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    return tokenizer
