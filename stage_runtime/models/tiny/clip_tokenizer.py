"""A tiny, self-contained CLIP tokenizer built without downloading anything.

The vocabulary mirrors the layout of OpenAI's CLIP BPE vocabulary (256 byte-level
characters, their ``</w>`` end-of-word variants, merged tokens, then the two special
tokens) but is much smaller: merges are derived from a short list of common English
words so that prompts like "a photo of a cat" encode to whole-word tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from transformers import CLIPTokenizer

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 77

# Words whose spelling is turned into BPE merges (one whole-word token each).
COMMON_WORDS = (
    "a an the of and in on with at to for from by is are this that it "
    "photo picture painting drawing image portrait render style art "
    "cat dog bird horse car house tree flower mountain city street sky sun moon "
    "water sea river forest beach field road man woman person child people face "
    "red green blue yellow black white orange purple brown gray "
    "big small old new beautiful cute happy dark light bright night day "
    "sitting standing running flying table chair window room garden snow rain"
).split()


def bytes_to_unicode() -> dict[int, str]:
    """Return CLIP/GPT-2's reversible mapping from the 256 byte values to printable chars."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def apply_merges(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Segment ``symbols`` the way BPE does: repeatedly merge the lowest-ranked pair."""
    symbols = list(symbols)
    while len(symbols) > 1:
        pairs = [(ranks.get(p, len(ranks)), i) for i, p in enumerate(zip(symbols, symbols[1:], strict=False))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def add_whole_word(symbols: list[str], ranks: dict[tuple[str, str], int], tokens: list[str]) -> None:
    """Rank the merges that make ``symbols`` one token (segmented with ``ranks`` first, then joined left to
    right) and append the tokens they make to ``tokens`` (the byte-level BPE builders of Qwen2 and Gemma)."""
    segments = apply_merges(symbols, ranks)
    current = segments[0]
    for segment in segments[1:]:
        ranks[(current, segment)] = len(ranks)
        current += segment
        tokens.append(current)


def word_merges(word: str, ranks: dict[tuple[str, str], int]) -> list[tuple[str, str]]:
    """New merges that make ``word`` (``</w>`` on its last char) a single token.

    The word is first segmented with the existing merges (``ranks``), then the
    segments are joined left to right, so earlier merges never split it again.
    """
    segments = apply_merges(list(word[:-1]) + [word[-1] + "</w>"], ranks)
    merges = []
    current = segments[0]
    for seg in segments[1:]:
        merges.append((current, seg))
        current += seg
    return merges


def build_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Build the (vocab, merges) pair: bytes, ``</w>`` bytes, merged tokens, specials."""
    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars]
    ranks: dict[tuple[str, str], int] = {}
    for word in COMMON_WORDS:
        for pair in word_merges(word, ranks):
            ranks[pair] = len(ranks)
            tokens.append(pair[0] + pair[1])
    merges = list(ranks)
    tokens += [BOS_TOKEN, EOS_TOKEN]
    vocab: dict[str, int] = {}
    for tok in tokens:
        vocab.setdefault(tok, len(vocab))
    return vocab, merges


def build_clip_tokenizer() -> "CLIPTokenizer":
    """Return a small ``CLIPTokenizer`` (pad = eos = ``<|endoftext|>``, max length 77).

    Note: with transformers 5 the vocab must be passed as ``vocab=`` (dict) and
    ``merges=`` (list of tuples); ``vocab_file=``/``merges_file=`` are silently ignored.
    """
    from transformers import CLIPTokenizer

    vocab, merges = build_vocab_and_merges()
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
    )
