"""A tiny Gemma tokenizer built in code (no download).

Gemma's layout in small: a BPE model with byte fallback over a normalizer that turns spaces into ``▁`` (no
prefix space is added, so the first word of a text has no ``▁``). The vocabulary: Gemma's special ids (pad 0,
eos 1, bos 2, unk 3, mask 4), Gemma 3's image tokens, the 256 byte tokens ``<0x00>``..``<0xFF>`` (any character
not in the vocabulary falls back to its UTF-8 bytes, so nothing is ``<unk>``), ``▁`` and the printable ASCII
characters, then merged whole-word tokens (bare and ``▁``-prefixed) for a short word list: "a photo of a cat"
encodes to ``<bos>`` and five word ids.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

from stage_runtime.models.tiny.clip_tokenizer import COMMON_WORDS, add_whole_word

if TYPE_CHECKING:  # pragma: no cover
    from transformers import GemmaTokenizer

SPACE = "\u2581"
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")   # Gemma 3's boi, eoi, image
CHARACTERS = string.ascii_letters + string.digits + string.punctuation
MODEL_MAX_LENGTH = 1024


def build_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges): specials, image tokens, bytes, characters, then each word (bare and ``▁word``)."""
    tokens = [*SPECIALS, *IMAGE_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), SPACE, *CHARACTERS]
    ranks: dict[tuple[str, str], int] = {}
    for word in (form for w in dict.fromkeys(COMMON_WORDS) for form in (w, SPACE + w)):
        add_whole_word(list(word), ranks, tokens)
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab, list(ranks)


def build_gemma_tokenizer() -> "GemmaTokenizer":
    """A small ``GemmaTokenizer`` (adds ``<bos>``; pads on the left, as Gemma does)."""
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer

    vocab, merges = build_vocab_and_merges()
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, model_max_length=MODEL_MAX_LENGTH)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in IMAGE_TOKENS])
    return tokenizer
