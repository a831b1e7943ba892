"""Qwen-Image-Edit (QwenImageEditPipeline) and Qwen-Image-Edit-Plus (QwenImageEditPlusPipeline, several input
images): instruction edits on Qwen-Image's transformer, VAE and Qwen2.5-VL encoder (models/families/qwen_image.py).

An edit (``POST /v1/images/edits``: image(s) and the instruction, no mask, no strength) starts from noise and
runs every step. Its pictures condition it twice, as the pipelines do:

    text      the instruction in the Edit prompt template, encoded by Qwen2.5-VL together with the picture(s)
              (models/families/qwen_vl_processor.py). Edit: the picture resized to about a megapixel (its aspect ratio,
              sides multiples of 32); Edit-Plus: each picture at about 384x384, each announced "Picture k: "
    tokens    each picture resized to about a megapixel, VAE-encoded (the mode), normalised and packed 2x2,
              appended to the image tokens of every forward; ``img_shapes`` lists the output's grid, then each
              picture's; the prediction keeps the output's tokens

True CFG as Qwen-Image (``guidance_scale`` is ``true_cfg_scale``; the negative prompt, ``" "`` by default, is
encoded with the same pictures; the guided prediction is rescaled to the conditional one's norm). One step
is ONE transformer forward over every request's rows (``[cond x n; negative x n]`` when guided), in request
mode too (the wave's step loop), so CFG-parallel splits the rows like any other. The text of a tick is padded
to its longest row, with a key mask. The picture latents are encoded once per request (the mode: no
generator) and repeated for its ``n`` images; the noise comes from the request's generators, one per image.

The output size is the request's (``size: auto``: the first picture's, rounded down to the size multiple);
diffusers' own default would be the megapixel size. A forward needs one token layout, so both compatibility
keys add "edit_shapes" (the uploaded images' sizes): edits of differently sized pictures never share one.
Guidance is per request (its rows, its scale), so in step mode edits of different guidance scales, step
counts and prompts share ticks; a request-mode wave shares its steps and guidance (``request_key``).
The pipelines need a picture: a request without one is a 400 (``edits_only``). Not yet: Ulysses and ring
(untested with the picture tokens), the block cache, LoRA.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE,
                                                                         calculate_dimensions)
from PIL import Image

from stage_runtime.models.flow_match import request_flow_scheduler
from stage_runtime.models.families.qwen_image import DEFAULT_NEGATIVE, MAX_SEQUENCE_LENGTH, QWEN_MAX_SHIFT, QwenImageAdapter
from stage_runtime.models.families.qwen_vl_processor import load_processor
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest, EditInput

PLUS = "QwenImageEditPlusPipeline"
MAX_PLUS_IMAGES = 4            # Edit-Plus: pictures per edit (Qwen's guidance: 1 to 3 work best; each adds tokens)


def picture_sizes(shape: tuple[int, int], area: int) -> tuple[int, int]:
    """(height, width) the pipelines resize a picture of ``shape`` to: about ``area`` pixels at its aspect ratio."""
    width, height = calculate_dimensions(area, shape[1] / shape[0])
    return int(height), int(width)


class QwenImageEditAdapter(QwenImageAdapter):
    pipeline_classes = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    tiny_kinds = ("qwen-image-edit", "qwen-image-edit-plus")
    parallel_kinds = frozenset({"cfg"})
    edits_only = True
    supports_block_cache = False
    lora_components = ("transformer",)                             # as QwenImageLoraLoaderMixin
    request_key_fields = ("height", "width", "num_inference_steps", "guidance_scale", "edit_shapes")
    step_key_fields = ("height", "width", "edit_shapes")        # guidance is per request rows

    @classmethod
    def load(cls, path: str, device: torch.device, dtype: str = "float32", **components) -> "QwenImageEditAdapter":
        from diffusers import DiffusionPipeline

        from stage_runtime.models.adapter import DTYPES

        pipe = DiffusionPipeline.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True,
                                                 low_cpu_mem_usage=cls.low_cpu_mem_usage,
                                                 processor=load_processor(path), **components)
        return cls(pipe.to(device), device)

    @property
    def plus(self) -> bool:
        return type(self.pipe).__name__ == PLUS

    def edit_tasks(self) -> tuple[str, ...]:
        return ("instruct",)

    def max_edit_images(self) -> int:
        return MAX_PLUS_IMAGES if self.plus else 1

    def default_size(self) -> tuple[int, int]:
        """What the pipelines make from a square picture (about a megapixel: 1024x1024)."""
        return picture_sizes((1, 1), VAE_IMAGE_SIZE)

    def parallel_refusal(self, kind: str) -> str | None:
        return (f"{type(self.pipe).__name__}: Ulysses and ring are untested with the input pictures' tokens (and "
                "tensor parallel is not written for Qwen-Image); use cfg_parallel_size=2 or replicas")

    # -- the pictures, as the pipelines' __call__ prepares them ------------------------------------------
    def token_layout(self, request: DiffusionRequest) -> list[tuple[int, int, int]]:
        """The transformer's ``img_shapes`` entry: (frames, rows, columns) of the output's packed tokens, then of
        each picture's."""
        factor = self.vae_scale_factor * 2
        sizes = [(request.sampling.height, request.sampling.width)]
        sizes += [picture_sizes(shape, VAE_IMAGE_SIZE) for shape in request.edit.shapes]
        return [(1, height // factor, width // factor) for height, width in sizes]

    def pictures(self, edit: EditInput) -> tuple[list[Image.Image], list[torch.Tensor]]:
        """(the pictures Qwen2.5-VL sees, the VAE's input tensors (1, 3, 1, H, W)), resized as the pipeline does."""
        processor, text_images, vae_images = self.pipe.image_processor, [], []
        for array in edit.images:
            picture = Image.fromarray(array, mode="RGB")
            height, width = picture_sizes(array.shape[:2], VAE_IMAGE_SIZE)
            if self.plus:
                text_images.append(processor.resize(picture, *picture_sizes(array.shape[:2], CONDITION_IMAGE_SIZE)))
            else:
                picture = processor.resize(picture, height, width)
                text_images.append(picture)
            vae_images.append(processor.preprocess(picture, height, width).unsqueeze(2))
        return text_images, vae_images

    def _encode_with(self, text: str, images, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, T, D) embeddings of the templated text with the pictures, and their (n, T) mask (all ones)."""
        embeds, mask = self.pipe.encode_prompt(prompt=[text], image=images, device=self.device,
                                               num_images_per_prompt=n, max_sequence_length=MAX_SEQUENCE_LENGTH)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    # -- step contract -------------------------------------------------------------------------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        text_images, vae_images = self.pictures(request.edit)
        if not self.plus:                             # QwenImageEditPipeline takes one picture, not a list
            text_images, vae_images = text_images[0], vae_images[0]
        do_cfg = s.guidance_scale > 1
        embeds, mask = self._encode_with(request.prompt, text_images, n)
        cond = {"embeds": embeds, "mask": mask}
        if do_cfg:
            negative = s.negative_prompt if s.negative_prompt is not None else DEFAULT_NEGATIVE
            cond["neg_embeds"], cond["neg_mask"] = self._encode_with(negative, text_images, n)
        latents, cond["image_latents"] = pipe.prepare_latents(
            vae_images, n, pipe.transformer.config.in_channels // 4, s.height, s.width, embeds.dtype, self.device,
            self.generators([request]))
        scheduler = request_flow_scheduler(pipe.scheduler, s.num_inference_steps, self.device, latents.shape[1],
                                           QWEN_MAX_SHIFT, np.linspace(1.0, 1 / s.num_inference_steps,
                                                                       s.num_inference_steps))
        return StepRequestState(request, scheduler, latents, do_cfg, cond=cond)

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        rows, texts, masks, timesteps = [], [], [], []
        for st in states:
            joint = torch.cat([st.latents, st.cond["image_latents"]], dim=1)      # output tokens, then pictures'
            for embeds, mask in [("embeds", "mask"), ("neg_embeds", "neg_mask")][:2 if st.do_cfg else 1]:
                rows.append(joint)
                texts.append(st.cond[embeds])
                masks.append(st.cond[mask])
                timesteps.append(st.timestep.reshape(1).expand(len(st.latents)))
        longest = max(t.shape[1] for t in texts)
        text = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[1])) for t in texts])
        mask = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for m in masks])
        hidden = torch.cat(rows)
        # One img_shapes entry for every row: the layout is shared (the step key), the rotary table reads the first
        # entry only, and zero_cond_t's per-token modulation index then broadcasts over the rows of any split.
        lora_rows = [(st.request, len(st.latents) * (2 if st.do_cfg else 1)) for st in states]
        with self.lora_rows("transformer", lora_rows):
            noise = self.pipe.transformer(
                hidden_states=hidden, timestep=torch.cat(timesteps).to(hidden.dtype) / 1000,
                encoder_hidden_states=text, encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                img_shapes=[self.token_layout(states[0].request)], return_dict=False)[0]
        preds, row = [], 0
        for st in states:
            n, tokens = st.latents.shape[:2]
            pred = noise[row:row + n, :tokens]
            if st.do_cfg:
                neg = noise[row + n:row + 2 * n, :tokens]
                comb = neg + st.request.sampling.guidance_scale * (pred - neg)
                pred = comb * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
            preds.append(pred)
            row += 2 * n if st.do_cfg else n
        return preds
