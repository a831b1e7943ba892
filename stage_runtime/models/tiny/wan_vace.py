"""A tiny WanVACEPipeline in the Wan 2.1 VACE layout (video-to-video: a control/source video, an optional mask video
and reference images): the tiny Wan parts with a 2-layer WanVACETransformer3DModel whose VACE branch runs beside
both layers (``vace_layers`` [0, 1]) and takes 96 control channels: the source video's inactive and reactive VAE
latents (16 + 16) and the mask folded 8 x 8 into 64 channels (the VAE's spatial factor squared). Flow matching
with a static shift of 7, as diffusers' VACE tests.

Facts for the adapter (diffusers 0.42.1 ``pipeline_wan_vace.py``):
- inputs: ``video`` (a list of frames), ``mask`` (a list of frames: white = generate, black = keep; needs
  ``video``), ``reference_images`` (PIL or a list of PIL), ``conditioning_scale`` (1.0: a float per VACE layer).
  Without a video the control video is zeros and the mask ones (text-to-video through the VACE branch).
- one video per call: a list prompt, ``num_videos_per_prompt`` > 1 and a list of generators raise ``ValueError``.
- the source video is used at its own size when it fits in height x width (larger: scaled down to fit), rounded
  down to multiples of 16; its frame count gives the control latent frames. When its latent grid differs from
  the generated video's (``height`` x ``width``, ``num_frames``), the transformer fails or the control tokens are
  zero-padded: a served request makes them equal (admission).
- each reference image is letterboxed onto a white canvas of the video's size and VAE-encoded alone: one more
  latent frame per reference before the video's (its control mask zero); the generated latents get the same
  extra frames (``num_frames + 4 x refs``) and the decoded video drops them.
- the VAE encodes with ``argmax`` (the mode): no randomness but the initial noise.
- size multiples of 16 (``ValueError`` otherwise); ``(F - 1) % 4 == 0`` (rounded down otherwise); fps 16.
About 500 KB on disk.
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import seeded
from stage_runtime.models.tiny.wan import Z_DIM, components, tiny_wan_transformer

VACE_LAYERS = [0, 1]
MASK_CHANNELS = 8 * 8                  # the VAE's spatial factor squared: prepare_masks folds 8 x 8 pixels
VACE_IN_CHANNELS = 2 * Z_DIM + MASK_CHANNELS


def tiny_wan_vace_transformer():
    """WanVACETransformer3DModel: the tiny Wan transformer's layout plus a VACE block beside each of its 2 layers."""
    from diffusers import WanVACETransformer3DModel

    layout = tiny_wan_transformer().config
    keep = {k: v for k, v in layout.items() if not k.startswith("_")}
    return WanVACETransformer3DModel(**keep, vace_layers=VACE_LAYERS, vace_in_channels=VACE_IN_CHANNELS)


def build(seed: int):
    from diffusers import WanVACEPipeline

    parts = components(seed)
    parts["transformer"] = seeded(seed + 2, tiny_wan_vace_transformer)
    return WanVACEPipeline(**parts, transformer_2=None)
