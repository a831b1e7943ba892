"""A tiny QwenImageEditPipeline: the tiny Qwen-Image parts (2-block dual-stream MMDiT, 2-layer Qwen2.5-VL
text encoder with a 1-layer vision tower, flow-matching Euler with Qwen-Image's dynamic shift), a VAE that
downsamples 16x, and the Qwen2.5-VL processor (models.families.qwen_vl_processor: tokenizer + PIL image processor).

Why 16x: the Edit pipelines condition on the input image resized to about a megapixel (1024x1024 for a
square one), whatever the output size; at 16x that is 32x32 packed tokens per input image (the tiny
Qwen-Image's 4x would make 16384), and a 64x64 output is 2x2 tokens. The VAE is 8 channels wide at every
level with no residual block on the way down (``num_res_blocks=0``: a level is one strided 2D convolution), so
only its first convolution computes at the full megapixel: the encode, still most of a tiny edit's cost on a
CPU, takes ~0.35 s on one thread (~1.1 s with a residual block at every level). The processor shrinks a picture to
at most 56x56 pixels for the vision tower: 4x4 patches, 4 ``<|image_pad|>`` tokens. The words of the Edit
prompt template are whole tokens, so its system prefix encodes to the 64 tokens the pipeline drops, as with
the real Qwen2 vocabulary.
"""

from __future__ import annotations

from stage_runtime.models.tiny.common import seeded

Z_DIM = 4
VAE_WIDTH = 8                        # the VAE's channels at every level
VL_MAX_PIXELS = 56 * 56              # the vision tower's input: at most 4x4 patches of 14 pixels
ATTENTION_SHARPNESS = 4.0
# The Edit template's words (its system prefix: 64 tokens with Qwen2's vocabulary) and Edit-Plus's "Picture 1: "
EDIT_WORDS = ("Describe key features input ( color , shape size texture objects background ), then explain how "
              "user 's text instruction should alter or modify . Generate new that meets requirements while "
              "maintaining consistency original where appropriate Picture :").split()


def tiny_vae():
    """AutoencoderKLQwenImage with 4 downsamplings (16x; the last one also in time), ``VAE_WIDTH`` channels at
    every level (``num_res_blocks=0`` leaves the encoder's levels their strided convolution only, which keeps the
    width, so it is one throughout; the decoder still has a residual block a level), convolution biases 0, and
    latent statistics that are its own.

    Biases 0: torch's initialisation shrinks a signal's variance about 3x a convolution and its random biases
    drown what is left (with them a picture or its mirror image moved an edit by 1 uint8: the decoder made
    nearly one image of any latents). 8 channels, not 4: a decoder level's upsampling halves the width, and the
    RMS norm of 2 channels (a point on a circle) jumps near 0: it made the float noise of a fused forward 10-20x
    larger in the image (~0.01 uint8, against ~0.001 at 8).

    ``latents_mean`` / ``latents_std`` are those of its encoding of a picture, so the pipeline's normalised image
    latents vary by about 1 (a random encoder's latents vary by a few hundredths about an offset, which would make
    every input image alike to the transformer). The decoder's first 1x1 convolution takes the de-normalisation
    back, so it decodes unit-scale latents as before."""
    import torch
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(
        base_dim=VAE_WIDTH, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0,
        temperal_downsample=[False, False, False, True],
    )
    side = 256
    y, x = torch.meshgrid(torch.linspace(0, 1, side), torch.linspace(0, 1, side), indexing="ij")
    picture = torch.stack([torch.sin(6 * x), torch.cos(5 * y), 2 * x * y - 1])[None, :, None]
    with torch.no_grad():
        for conv in vae.modules():
            if isinstance(conv, (torch.nn.Conv2d, torch.nn.Conv3d)):
                conv.bias.zero_()
        latents = vae.encode(picture).latent_dist.mode()
        mean = [round(float(v), 6) for v in latents.mean(dim=(0, 2, 3, 4))]
        std = [round(float(v), 6) for v in latents.std(dim=(0, 2, 3, 4))]
        vae.register_to_config(latents_mean=mean, latents_std=std)
        mean, std = torch.tensor(mean), torch.tensor(std)
        conv = vae.post_quant_conv
        weight = conv.weight / std.view(1, -1, 1, 1, 1)
        conv.bias -= (weight[:, :, 0, 0, 0] * mean).sum(dim=1)
        conv.weight.copy_(weight)
    return vae


def tiny_transformer(zero_cond_t: bool = False):
    """The tiny Qwen-Image transformer with sharper attention (its query and key RMSNorm weights x4: random
    logits average the 1024 tokens of an input image into one colour, and drown the ~20 text tokens);
    ``zero_cond_t``: the input images' tokens modulated at timestep 0 (Qwen-Image-Edit-2511)."""
    import torch
    from diffusers import QwenImageTransformer2DModel

    from stage_runtime.models.tiny.common import NUM_HEADS
    from stage_runtime.models.tiny.qwen_image import TEXT_HIDDEN

    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=2, attention_head_dim=16,
        num_attention_heads=NUM_HEADS, joint_attention_dim=TEXT_HIDDEN, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6), zero_cond_t=zero_cond_t,
    )
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for norm in (block.attn.norm_q, block.attn.norm_k, block.attn.norm_added_q, block.attn.norm_added_k):
                norm.weight.mul_(ATTENTION_SHARPNESS)
    return transformer


def tiny_processor(tokenizer):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from stage_runtime.models.families.qwen_vl_processor import ImageTextProcessor

    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=VL_MAX_PIXELS)
    return ImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                              chat_template=tokenizer.chat_template)


def build_edit(pipeline_class: str, seed: int, zero_cond_t: bool = False):
    """A tiny ``pipeline_class`` (QwenImageEditPipeline or QwenImageEditPlusPipeline)."""
    import diffusers

    from stage_runtime.models.tiny.qwen2_tokenizer import build_qwen2_tokenizer
    from stage_runtime.models.tiny.qwen_image import _tiny_text_encoder, flow_match_scheduler

    tokenizer = build_qwen2_tokenizer(EDIT_WORDS)
    pipe = getattr(diffusers, pipeline_class)(
        scheduler=flow_match_scheduler(),
        vae=seeded(seed, tiny_vae),
        text_encoder=seeded(seed + 1, lambda: _tiny_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        processor=tiny_processor(tokenizer),
        transformer=seeded(seed + 2, lambda: tiny_transformer(zero_cond_t)),
    )
    pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))    # as a real folder names it
    return pipe


def build(seed: int):
    return build_edit("QwenImageEditPipeline", seed)
