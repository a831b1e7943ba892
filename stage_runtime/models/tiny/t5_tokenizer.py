"""A tiny T5 tokenizer and T5 / UMT5 encoders built without downloading anything.

The tokenizer is a ``tokenizers`` Unigram model (what T5's SentencePiece vocabulary becomes in the fast
tokenizer) wrapped in ``T5TokenizerFast``: T5's special ids (pad 0, eos 1, unk 2), the metaspace ``▁``,
then whole-word pieces ``▁word`` for a short list of common English words, then single characters with
and without ``▁``. Word pieces score higher than characters, so "a photo of a cat" encodes to five
whole-word ids plus ``</s>``; any other text falls back to characters (unknown characters → ``<unk>``).
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

from stage_runtime.models.tiny.clip_tokenizer import COMMON_WORDS

if TYPE_CHECKING:  # pragma: no cover
    from transformers import T5TokenizerFast

PAD, EOS, UNK, SPACE = "<pad>", "</s>", "<unk>", "\u2581"
MODEL_MAX_LENGTH = 512
WORD_SCORE, CHAR_SCORE = -5.0, -10.0      # log-probabilities: one word piece beats several characters
CHARACTERS = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation

# The T5 encoder's size: hidden 32 (the joint attention width of the tiny FLUX / SD3 transformers).
T5_HIDDEN = 32


def build_vocab() -> list[tuple[str, float]]:
    """(piece, score) in id order: specials, ``▁``, ``▁word`` pieces, ``▁c`` and ``c`` characters."""
    pieces = [(PAD, 0.0), (EOS, 0.0), (UNK, 0.0), (SPACE, CHAR_SCORE)]
    pieces += [(SPACE + word, WORD_SCORE) for word in dict.fromkeys(COMMON_WORDS)]
    pieces += [(SPACE + c, CHAR_SCORE) for c in CHARACTERS]
    pieces += [(c, CHAR_SCORE - 1.0) for c in CHARACTERS]
    seen: set[str] = set()
    return [(p, s) for p, s in pieces if not (p in seen or seen.add(p))]     # the first of a repeated piece wins


def build_t5_tokenizer() -> "T5TokenizerFast":
    """A ``T5TokenizerFast`` over the Unigram vocabulary above (no sentinel ``<extra_id_*>`` tokens)."""
    from transformers import T5TokenizerFast

    return T5TokenizerFast(vocab=build_vocab(), extra_ids=0, eos_token=EOS, unk_token=UNK, pad_token=PAD,
                           model_max_length=MODEL_MAX_LENGTH)


def _encoder_config(config_class, tokenizer):
    return config_class(vocab_size=len(tokenizer), d_model=T5_HIDDEN, d_kv=16, d_ff=37, num_layers=2, num_heads=2,
                        relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                        decoder_start_token_id=tokenizer.pad_token_id)


def tiny_t5_encoder(tokenizer):
    """T5EncoderModel (2 layers, 2 heads of 16, hidden 32) whose ids match ``tokenizer``."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(_encoder_config(T5Config, tokenizer))


def tiny_umt5_encoder(tokenizer):
    """UMT5EncoderModel of the same size (Wan's text encoder: T5 with a relative position bias in every layer)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(_encoder_config(UMT5Config, tokenizer))
