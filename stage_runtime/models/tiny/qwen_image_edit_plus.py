"""A tiny QwenImageEditPlusPipeline (several input images): the tiny Qwen-Image-Edit parts, with the input
images' tokens modulated at timestep 0 (``zero_cond_t``, as Qwen-Image-Edit-2511 ships it)."""

from __future__ import annotations


def build(seed: int):
    from stage_runtime.models.tiny.qwen_image_edit import build_edit

    return build_edit("QwenImageEditPlusPipeline", seed, zero_cond_t=True)
