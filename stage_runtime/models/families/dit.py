"""DiT pipelines (class-conditional DiTTransformer2DModel + AutoencoderKL).

DiT is conditioned on an ImageNet-style class id, not text. A prompt maps to a class id: a decimal
number is taken as the id, a known label (the pipeline's ``id2label``) as its id, anything else as a
stable CRC32 hash of the text modulo the number of classes. The image size is fixed by the model.

Refusals at admission (``models.refusals.DiTRefusals``, from the ``num_classes`` and ``class_labels`` this
adapter reports): a class id out of range (the class embedding has no such row), a negative prompt (none).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.refusals import DiTRefusals, class_id
from stage_runtime.models.step_contract import StepContract
from stage_runtime.request import DiffusionRequest
from stage_runtime.models.step_state import StepRequestState

NULL_CLASS = 1000         # DiTPipeline's unconditional class id for guidance


class DiTAdapter(DiTRefusals, StepContract, PipelineAdapter):
    pipeline_classes = ("DiTPipeline",)
    tiny_kinds = ("dit", "digits")           # digits: trained (models/tiny/digits.py), not random
    default_guidance = 4.0
    parallel_kinds = frozenset({"cfg", "ulysses", "ring", "tp"})
    fixed_size = True
    supports_block_cache = True          # models.block_cache: first block, then the rest or its residual
    compile_blocks = ("BasicTransformerBlock",)   # DiTTransformer2DModel declares no _repeated_blocks

    @property
    def num_classes(self) -> int:
        return int(self.pipe.transformer.config.num_embeds_ada_norm)

    def family_facts(self) -> dict:
        labels = getattr(self.pipe, "labels", None) or {}
        return {"num_classes": self.num_classes,
                "class_labels": tuple((label, int(cid)) for label, cid in labels.items())}

    def class_label(self, prompt: str) -> int:
        return class_id(prompt, getattr(self.pipe, "labels", None) or {}, self.num_classes)

    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        return self.call_pipeline(requests, class_labels=[self.class_label(r.prompt) for r in self.image_rows(requests)])

    # -- step contract: the same math as DiTPipeline.__call__, one step at a time ------------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        s, n, config = request.sampling, request.sampling.num_outputs, self.pipe.transformer.config
        do_cfg = s.guidance_scale > 1
        shape = (n, config.in_channels, config.sample_size, config.sample_size)
        latents = randn_tensor(shape, generator=self.generators([request]), device=self.device,
                               dtype=self.pipe.transformer.dtype)
        labels = torch.tensor([self.class_label(request.prompt)] * n, device=self.device)
        if do_cfg:        # conditional rows first, then the null class (DiT's order)
            labels = torch.cat([labels, torch.full_like(labels, NULL_CLASS)])
        return StepRequestState(request, self.noise_scheduler_for(s.num_inference_steps), latents, do_cfg,
                                cond={"labels": labels})

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        channels = self.pipe.transformer.config.in_channels
        learned_sigma = self.pipe.transformer.config.out_channels // 2 == channels
        rows, timesteps = self.model_inputs(states)
        noise = self.pipe.transformer(torch.cat(rows), timestep=timesteps,
                                      class_labels=torch.cat([st.cond["labels"] for st in states])).sample
        preds = []
        for st, pred in zip(states, self.split_rows(noise, rows), strict=True):
            eps = pred[:, :channels] if learned_sigma else pred
            if st.do_cfg:
                cond_eps, uncond_eps = eps.chunk(2)          # DiT's row order: conditional first
                eps = self.guided(uncond_eps, cond_eps, st.request.sampling.guidance_scale)
            preds.append(eps)
        return preds

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        vae = self.pipe.vae
        samples = vae.decode(state.latents / vae.config.scaling_factor).sample
        samples = (samples / 2 + 0.5).clamp(0, 1).cpu().permute(0, 2, 3, 1).float().numpy()
        return self.to_uint8(samples)
