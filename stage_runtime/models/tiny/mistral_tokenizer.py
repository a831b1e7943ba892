"""A tiny Mistral-style tokenizer built in code (no download), for the tiny Flux2Pipeline's text encoder.

FLUX.2 [dev] ships Mistral Small 3.1's ``PixtralProcessor`` as its ``tokenizer``; the pipeline only calls its
``apply_chat_template`` over text conversations (a system message, then the prompt; content as
``[{"type": "text", "text": ...}]`` lists), padded to ``max_sequence_length`` tokens. A ``PixtralProcessor`` cannot
be built without torchvision (not a dependency here), so the tiny folder's ``tokenizer`` is the plain tokenizer
the processor wraps, which answers the same call: Mistral's tekken is a byte-level BPE, built here with the
``tokenizers`` library over the byte-level vocabulary of ``qwen2_tokenizer`` (every byte a token, whole-word
merges for the system message's and the tests' words), Mistral's special tokens (``<unk>`` 0, ``<s>`` 1, ``</s>``
2, ``[INST]``, ``[SYSTEM_PROMPT]``, the image tokens, ``<pad>``) and a Mistral Small 3 chat template::

    <s>[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{prompt}[/INST]
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from stage_runtime.models.tiny.qwen2_tokenizer import build_vocab_and_merges

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerFast

SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
            "[IMG_BREAK]", "[IMG_END]", "<pad>")
MODEL_MAX_LENGTH = 131072
# Mistral Small 3's format for text conversations; a message's content is a string or a list of typed parts
# (its text parts joined), as FLUX.2's format_input writes them.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}")


def system_words() -> list[str]:
    """The words (and punctuation) of FLUX.2's system message, merged into whole tokens."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return re.findall(r"\w+|[^\w\s]", SYSTEM_MESSAGE)


def build_mistral_tokenizer() -> "PreTrainedTokenizerFast":
    """A small byte-level BPE ``PreTrainedTokenizerFast`` with Mistral's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words, merges = build_vocab_and_merges(system_words())
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for token in words:                                   # qwen2's specials are not Mistral's: left out
        if not token.startswith("<|"):
            vocab.setdefault(token, len(vocab))
    model = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>", model_max_length=MODEL_MAX_LENGTH,
                                        chat_template=CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS[3:10])})
    return tokenizer
