"""A prompt longer than a video family's text encoder keeps is a 400 at admission naming the field, its token count
and the limit (diffusers would cut it silently and make a video of the rest); one at the limit is admitted; the
count is the pipeline's own tokenizer's; an image family keeps diffusers' behaviour (CLIP's 77 tokens cut)."""

from __future__ import annotations

import pytest
from engine_probes import threadless
from transformers import AutoTokenizer

from stage_runtime.engine.prompt_length import PromptLength
from stage_runtime.errors import InvalidRequestError
from stage_runtime.request import DiffusionRequest, SamplingParams


def prompt_of(counter: PromptLength, tokens: int) -> str:
    """A prompt of exactly ``tokens`` tokens as the model's tokenizer counts them (special tokens included)."""
    words = []
    for word in ("fox", "a"):            # a word of a few tokens, then a one-token word to land on the count
        while counter.count(" ".join(words + [word])) <= tokens:
            words.append(word)
    text = " ".join(words)
    assert counter.count(text) == tokens, (counter.count(text), tokens)
    return text


def video(rid: str, prompt: str, **kw) -> DiffusionRequest:
    sampling = SamplingParams(height=16, width=16, num_frames=5, num_inference_steps=2, **kw)
    return DiffusionRequest(rid, prompt, sampling, video=True)


@pytest.mark.parametrize("kind", ["wan", "hunyuan-video15"])
def test_the_count_is_the_pipelines_own_tokenizers(kind, tiny_model):
    path = tiny_model(kind)
    engine = threadless(path)
    try:
        counter = engine.prompt_length
        assert counter is not None and counter.limit == engine.model_info.max_sequence_length
        own = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
        for text in ("a red fox", "a red fox  jumps over\nthe lazy dog, twice", "fox " * 40):
            assert counter.count(text) == len(own(" ".join(text.split()))["input_ids"])
    finally:
        engine.close()


def test_a_prompt_past_the_limit_is_a_400_naming_the_field_the_count_and_the_limit(tiny_wan_path):
    engine = threadless(tiny_wan_path)
    try:
        counter, limit = engine.prompt_length, engine.model_info.max_sequence_length
        at_limit = prompt_of(counter, limit)
        engine.add_request(video("fits", at_limit))                              # admitted: queued
        assert engine.stats()["waiting"] == 1
        with pytest.raises(InvalidRequestError) as refused:
            engine.add_request(video("long", at_limit + " a"))
        assert (refused.value.field, refused.value.value) == ("prompt", f"{limit + 1} tokens")
        assert str(refused.value) == (
            f"prompt='{limit + 1} tokens': WanPipeline's text encoder keeps {limit} tokens (max_sequence_length) "
            "and would cut the rest silently; shorten it by 1 tokens")
        with pytest.raises(InvalidRequestError) as negative:
            engine.add_request(video("neg", "a fox", negative_prompt=at_limit + " a", guidance_scale=5.0))
        assert negative.value.field == "negative_prompt"
        assert engine.stats()["waiting"] == 1                                    # nothing else was queued
    finally:
        engine.close()


def test_an_image_family_cuts_as_diffusers_does(tiny_sd_path):
    engine = threadless(tiny_sd_path)
    try:
        assert engine.model_info.prompt_tokenizer is None and engine.prompt_length is None
        engine.add_request(DiffusionRequest("long", "fox " * 200, SamplingParams(num_inference_steps=2)))
        assert engine.stats()["waiting"] == 1
    finally:
        engine.close()
