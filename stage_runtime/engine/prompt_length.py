"""A prompt longer than the family's text encoder keeps is a 400 at admission (``prompt`` / ``negative_prompt``,
with its token count and the limit), not a video made minutes later from a silently cut prompt.

diffusers cuts a prompt at ``max_sequence_length`` tokens without a word. For the families that say so
(``PipelineAdapter.refuses_long_prompts``: the video families) the worker reports the model's own
``tokenizer/tokenizer.json`` (``ModelInfo.prompt_tokenizer``) and the engine counts with it through the
``tokenizers`` library (Rust; no torch in the engine process), special tokens included, whitespace collapsed
as the pipelines clean a prompt. HunyuanVideo-1.5 wraps the prompt in a chat template whose few closing tokens
share the limit: a prompt within them of the limit still loses them (the count here is the prompt's own).
"""

from __future__ import annotations

from stage_runtime.errors import InvalidRequestError
from stage_runtime.model_info import ModelInfo
from stage_runtime.request import DiffusionRequest


class PromptLength:
    """Counts prompt tokens with the model's tokenizer; refuses what the encoder would cut."""

    def __init__(self, tokenizer_file: str, limit: int, pipeline_class: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_file)
        self.limit, self.pipeline_class = limit, pipeline_class

    @classmethod
    def for_model(cls, info: ModelInfo) -> "PromptLength | None":
        if info.prompt_tokenizer is None or info.max_sequence_length is None:
            return None
        return cls(info.prompt_tokenizer, info.max_sequence_length, info.pipeline_class)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(" ".join(text.split())).ids)

    def check(self, request: DiffusionRequest) -> None:
        for field, text in (("prompt", request.prompt), ("negative_prompt", request.sampling.negative_prompt)):
            if not text:
                continue
            tokens = self.count(text)
            if tokens > self.limit:
                raise InvalidRequestError(field, f"{tokens} tokens", (
                    f"{self.pipeline_class}'s text encoder keeps {self.limit} tokens (max_sequence_length) and "
                    f"would cut the rest silently; shorten it by {tokens - self.limit} tokens"))
