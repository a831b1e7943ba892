"""Rank-side code of the FLUX.2 parallel tests (test_flux2_parallel.py): CFG parallel (Klein), Ulysses and ring
(FLUX.2 [dev] and Klein) on real gloo ranks.

Reuses dist_rank_checks (adapter loading, the request/step scenarios, spawn and reaping) and joint_rank_checks' job
(the replaced-processor refusal on a single-stream block); adds what is FLUX.2's: counting its sequence-parallel
processors and the transformer called directly on uneven token counts. A spawned child imports this module by name.
"""

from __future__ import annotations

import dist_rank_checks as checks
import joint_rank_checks as joint


def installed(denoiser) -> dict:
    """CFG forward wrapper present; how many attentions run a FLUX.2 sequence-parallel processor, of each kind."""
    from stage_runtime.models.families.flux2 import Flux2UlyssesProcessor, Flux2UlyssesSingleProcessor

    processors = [getattr(m, "processor", None) for m in denoiser.modules()]
    return {"cfg": getattr(denoiser, "_diffstage_cfg_parallel", None) is not None,
            "double": sum(isinstance(p, Flux2UlyssesProcessor) for p in processors),
            "single": sum(isinstance(p, Flux2UlyssesSingleProcessor) for p in processors)}


def transformer_outputs(adapter) -> dict:
    """The transformer called directly, as float arrays: 3 rows (CFG 2: 2 + 1 padded) at different timesteps
    (and guidance, where it embeds one), with 7 text tokens (uneven chunks) and 4x4 = 16, 3x3 = 9 (uneven) and
    1x1 = 1 image tokens (fewer than the ranks: unsharded)."""
    import torch

    pipe, out = adapter.pipe, {}
    gen = torch.Generator().manual_seed(0)
    config = pipe.transformer.config
    text = torch.randn(3, 7, config.joint_attention_dim, generator=gen)
    text_ids = pipe._prepare_text_ids(text)[0]
    guidance = torch.tensor([4.0, 2.5, 1.0]) if config.guidance_embeds else None
    with torch.inference_mode():
        for side in (4, 3, 1):
            latents = torch.randn(3, config.in_channels, side, side, generator=gen)
            image_ids = pipe._prepare_latent_ids(latents)[0]
            hidden = pipe._pack_latents(latents)
            out[f"{side * side}-tokens"] = pipe.transformer(
                hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([0.95, 0.6, 0.3]),
                guidance=guidance, txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0].numpy()
    return out


JOBS = {"models": joint.models_job(installed, lambda denoiser: denoiser.single_transformer_blocks[0].attn,
                                   transformer_outputs)}


def Ranks(world: int, runs: list[dict]) -> checks.Ranks:  # noqa: N802 - a constructor, as dist_rank_checks.Ranks
    """``world`` spawned ranks running this module's :func:`job` for every run (spawn and reaping are shared)."""
    return checks.Ranks(world, [{**run, "job": "models"} for run in runs], jobs_module=__name__)
