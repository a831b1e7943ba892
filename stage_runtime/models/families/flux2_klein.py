"""FLUX.2 [klein] (``Flux2KleinPipeline``): FLUX.2's transformer, VAE and schedule (``models/families/flux2.py``'s
``Flux2Base``) with a Qwen3 text encoder and, unlike [dev], no guidance embedding: the base models run real
classifier-free guidance against a negative prompt.

diffusers calls the transformer twice per step when guided (the prompt, then the negative prompt ``""``:
``do_classifier_free_guidance`` is ``guidance_scale > 1`` and not ``is_distilled``) and combines
``neg + s · (cond − neg)``. Here a step is ONE forward over every request's rows, ``[negative × n; prompt × n]``
for a guided request, ``[prompt × n]`` otherwise (both texts are padded to 512 tokens: one set of position ids),
and request mode runs that same loop for the wave, so both modes make one denoiser call per step and CFG parallel
splits the rows. Requests of different step counts and guidance scales (guided or not) share ticks.

The negative prompt: diffusers' ``__call__`` encodes ``""`` unless it is handed ``negative_prompt_embeds``; a
request's ``negative_prompt`` is encoded the same way and used as those embeddings (refused at guidance <= 1, where
diffusers would not use it). A step-distilled Klein folder (``is_distilled: true`` in ``model_index.json``)
ignores guidance: served as ``guidance: none``, 4 steps by default, a guidance scale or negative prompt refused.
"""

from __future__ import annotations

import numpy as np
import torch

from stage_runtime.models.families.flux2 import Flux2Base
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest


class Flux2KleinAdapter(Flux2Base):
    pipeline_classes = ("Flux2KleinPipeline",)
    tiny_kinds = ("flux2-klein",)
    guidance = "cfg"
    parallel_kinds = frozenset({"cfg", "ulysses", "ring"})
    request_mode_step_loop = True          # request mode runs the step loop: a request's CFG rows stay together

    def __init__(self, pipeline, device):
        super().__init__(pipeline, device)
        if self.pipe.config.is_distilled:                          # step-distilled: guidance is ignored
            self.guidance, self.default_guidance, self.default_steps = "none", 1.0, 4

    # -- request mode: the step loop, to the end, for the whole wave ---------------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        return self.run_step_loop(requests)

    # -- step contract -------------------------------------------------------------------------------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        state = self.new_state(request)
        s = request.sampling
        state.do_cfg = s.guidance_scale > 1 and not self.pipe.config.is_distilled
        if state.do_cfg:
            with self.batch_lora_rows([request], components=self.encoder_lora_components):
                state.cond["neg_embeds"], _ = self.encode(s.negative_prompt or "", s.num_outputs)
        return state

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        rows, per_state = [], []
        for st in states:
            branches = ("neg_embeds", "embeds") if st.do_cfg else ("embeds",)    # [uncond; cond], as SD orders them
            rows.extend((st, st.latents, st.cond[name]) for name in branches)
            per_state.append(torch.cat([st.latents] * len(branches)))
        noise = self.forward(states, rows)
        return self.guided_per_request(states, noise, per_state)
