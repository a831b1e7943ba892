"""A tiny WanImageToVideoPipeline in the Wan 2.1 I2V layout: the tiny Wan parts, a transformer that takes
36 channels (16 noisy latents + 4 first-frame mask + 16 image latents) and CLIP image tokens (``image_dim``
16), a tiny CLIPVisionModel (the real checkpoint's class; 2 layers, 2 heads of 8, 32x32 input in 8x8 patches:
16 + 1 tokens, the pipeline feeds the penultimate hidden states) and CLIP's image processor built in code
(resize and crop to 32; the PIL one, ``CLIPImageProcessorPil``: ``CLIPImageProcessor`` falls back to it
without torchvision, so the folder is the same on every machine).

Facts for the adapter (diffusers 0.42.1 ``pipeline_wan_i2v.py``): ``image`` is required (PIL, array or tensor);
it is resized to ``height`` x ``width`` for the VAE and to 32x32 for CLIP. Size multiples of 16
(``ValueError`` otherwise), ``(F - 1) % 4 == 0`` (rounded down otherwise), 16 latent channels, VAE x8 / x4,
``max_sequence_length`` 512, fps 16. Cross-attention sees 17 image + 512 text tokens. ``last_image``
(first-last-frame) needs Wan's FLF2V transformer (``pos_embed_seq_len``), not this one: it raises
``RuntimeError``. About 425 KB on disk.
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import seeded
from stage_runtime.models.tiny.wan import Z_DIM, components

IMAGE_HIDDEN, IMAGE_SIZE = 16, 32


def tiny_clip_vision():
    """CLIPVisionModel: 2 layers, 2 heads of 8, 32x32 images in 8x8 patches."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return CLIPVisionModel(CLIPVisionConfig(
        hidden_size=IMAGE_HIDDEN, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8))


def clip_image_processor():
    """CLIP's preprocessing (resize the short side, centre crop, CLIP mean/std) at the tiny encoder's size."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def build(seed: int):
    from diffusers import WanImageToVideoPipeline

    parts = components(seed, transformer={"in_channels": 2 * Z_DIM + 4, "image_dim": IMAGE_HIDDEN})
    return WanImageToVideoPipeline(**parts, image_processor=clip_image_processor(),
                                   image_encoder=seeded(seed + 4, tiny_clip_vision), transformer_2=None)
