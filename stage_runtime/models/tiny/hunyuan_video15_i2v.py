"""A tiny HunyuanVideo15ImageToVideoPipeline (HunyuanVideo-1.5 I2V): the tiny HunyuanVideo-1.5 parts
(``tiny/hunyuan_video15.py``: text encoders, VAE, scheduler, guider) with an image-to-video transformer
(``task_type="i2v"``, the same layout), a tiny SigLIP vision model (1 layer, 2 heads of 4, hidden 8 = the
transformer's ``image_embed_dim``; 16x16 input in 4x4 patches: 16 image tokens, the real one 729) and SigLIP's
image processor built in code (resize to 16x16, mean/std 0.5; the PIL one, ``SiglipImageProcessorPil``:
``SiglipImageProcessor`` falls back to it without torchvision, so the folder is the same on every machine).

Facts for the adapter (diffusers 0.42.1 ``pipeline_hunyuan_video1_5_image2video.py``):
- ``image`` (PIL) is required; ``__call__`` takes no height and width: the video's size is the bucket of
  ``generate_crop_size_list(target_size, vae factor)`` whose aspect ratio is nearest the picture's (on the
  picture's side of square), and the picture is resized and centre-cropped to it (here target 16, factor 4: a
  square picture makes 16x16; height x width 12x24 makes 12x20, 24x12 20x12, 10x40 8x32). Frames as T2V
  (``4k + 1``, else shorter).
- the picture conditions each forward twice: its SigLIP last hidden state (resized to the encoder's 16x16) as
  the image tokens (valid in the context mask: every row of the forward has to carry them, since the transformer
  masks the image tokens out only when ALL of the batch's ``image_embeds`` are zero), and its VAE latents (the
  distribution's mode x scaling factor) as the first latent frame of the conditioning latents, with a mask of
  ones on that frame (zeros after it), beside the noise: 9 input channels, as T2V.
- ``transformer.config.use_meanflow`` (off here, as the folder's default) adds ``timestep_r``: the next step's
  timestep (0 on the last step) per row.
About 17.8 MB on disk (as T2V: the ByT5 projection).
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import seeded
from stage_runtime.models.tiny.hunyuan_video15 import IMAGE_EMBED_DIM, components

IMAGE_SIZE = 16


def tiny_siglip_vision():
    """SiglipVisionModel: 1 layer, 2 heads of 4 (hidden 8), 16x16 images in 4x4 patches."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    return SiglipVisionModel(SiglipVisionConfig(
        hidden_size=IMAGE_EMBED_DIM, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=4))


def siglip_image_processor():
    """SigLIP's preprocessing (resize to the encoder's size, rescale, normalise with mean/std 0.5)."""
    from transformers import SiglipImageProcessorPil

    return SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def build(seed: int):
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    return HunyuanVideo15ImageToVideoPipeline(**components(seed, task_type="i2v"),
                                              image_encoder=seeded(seed + 4, tiny_siglip_vision),
                                              feature_extractor=siglip_image_processor())
