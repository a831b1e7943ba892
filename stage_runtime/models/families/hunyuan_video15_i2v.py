"""HunyuanVideo-1.5 image-to-video (HunyuanVideo15ImageToVideoPipeline): the text-to-video step loop
(models/families/hunyuan_video15.py: one forward per step over every request's guider rows) with the picture in it.

The picture (``input_reference``, required) is prepared once per request, exactly as ``__call__`` does:

    size        ``__call__`` takes no height and width: the video is the bucket of
                ``generate_crop_size_list(target_size, vae factor)`` nearest the picture's aspect ratio. A request
                without a size gets that bucket (ModelInfo ``reference_buckets``, video_request.reference_size);
                one with a size (a multiple of 16) gets it, the picture fitted to it the same way
    picture     resized to cover the size and centre-cropped (``video_processor.resize(..., "crop")``)
    image       its SigLIP last hidden state (``encode_image``), the image tokens of every row of the request,
                cond and uncond alike (valid in the context mask: the transformer masks them out only when a
                forward's image tokens are ALL zero, so image-to-video rows never share a forward with text-to-video
                ones: this class serves image-to-video only)
    latents     its VAE latents (the mode x scaling factor) as the first of the conditioning latents, the rest
                zero, and a mask of ones on the first latent frame (``prepare_cond_latents_and_mask``), beside the
                noise in every forward's input: [noise ‖ conditioning ‖ mask]
    timestep_r  a ``use_meanflow`` transformer only: the request's next timestep (0 on its last step), per row

Guidance, the two text encoders, decoding and the parallel paths are text-to-video's: CFG parallel splits the
image tokens and conditioning with the rest of each row; Ulysses and ring cut the [video ‖ context] tokens, the
image tokens among the context's valid ones.
"""

from __future__ import annotations

import torch
from PIL import Image

from stage_runtime.models.families.hunyuan_video15 import HunyuanStepState, HunyuanVideo15Adapter
from stage_runtime.request import DiffusionRequest


class HunyuanVideo15ImageToVideoAdapter(HunyuanVideo15Adapter):
    pipeline_classes = ("HunyuanVideo15ImageToVideoPipeline",)
    tiny_kinds = ("hunyuan-video15-i2v",)

    def family_facts(self) -> dict:
        return {**super().family_facts(), "reference": "required", "reference_buckets": self.size_buckets()}

    def size_buckets(self) -> tuple[tuple[int, int], ...]:
        """The (height, width) sizes ``__call__`` picks from by the picture's aspect ratio, in its order."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import generate_crop_size_list

        buckets = generate_crop_size_list(base_size=self.pipe.target_size, patch_size=self.vae_scale_factor)
        return tuple((int(h), int(w)) for h, w in buckets)

    def prepare_encode(self, request: DiffusionRequest) -> HunyuanStepState:
        state = super().prepare_encode(request)
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        dtype = pipe.transformer.dtype
        picture = pipe.video_processor.resize(Image.fromarray(request.reference, mode="RGB"), height=s.height,
                                              width=s.width, resize_mode="crop")
        state.cond["image_embeds"] = pipe.encode_image(image=picture, batch_size=n, device=self.device, dtype=dtype)
        state.cond["cond_latents"], state.cond["cond_mask"] = pipe.prepare_cond_latents_and_mask(
            latents=state.latents, image=picture, batch_size=n, height=s.height, width=s.width, dtype=dtype,
            device=self.device)
        return state

    def model_input(self, state: HunyuanStepState, latents: torch.Tensor) -> torch.Tensor:
        return torch.cat([latents, state.cond["cond_latents"], state.cond["cond_mask"]], dim=1)

    def image_tokens(self, state: HunyuanStepState) -> torch.Tensor:
        return state.cond["image_embeds"]

    def more_inputs(self, states: list[HunyuanStepState], branches: list[tuple[str, ...]]) -> dict[str, torch.Tensor]:
        """``timestep_r`` of a mean-flow transformer: each request's next timestep, 0 after its last, per row."""
        if not self.pipe.transformer.config.use_meanflow:
            return {}
        dtype, rows = self.pipe.transformer.dtype, []
        for st, names in zip(states, branches, strict=True):
            following = st.noise_scheduler.timesteps[st.t_start + st.step_index + 1:]
            r = following[0] if len(following) else torch.tensor(0.0, device=st.latents.device)
            rows.append(r.expand(len(names) * len(st.latents)).to(dtype))
        return {"timestep_r": torch.cat(rows)}
