"""Rank-side code of the Z-Image parallel tests (spawned gloo ranks, and the test process for the references).

One job, ``zimage``: load the tiny Z-Image, apply the run's topology, report what got installed, every scenario's
image (request and step mode; guided, weakly guided and unguided rows in one forward; prompts of different
lengths, so rows padded with a key mask), how often the denoiser was called, the transformer called directly
(float), and, under sequence parallel, the refusal of a replaced processor.
"""

from __future__ import annotations

import dist_rank_checks as checks

LONG = "a big red car parked on a long empty road by the sea at sunset"      # 38 caption tokens: padded to 64


def _request(rid: str, prompt: str, steps: int, seed: int, guidance: float, **kw):
    from stage_runtime.request import DiffusionRequest, SamplingParams

    return DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed, guidance_scale=guidance,
                                                        height=64, width=64, **kw))


def scenarios(adapter) -> dict:
    """Every image compared, keyed ``<scenario>/<request id>``: request mode guided (4 rows: [pos ‖ neg] of two
    requests, captions 32 and 64 tokens) and unguided (3 rows: an odd split), a single request (2 rows; 1 row: fewer
    than the ranks), and step mode with a guided, an unguided and a weakly guided request in one forward (6 rows,
    then 2)."""
    import torch

    out: dict = {}
    with torch.inference_mode():
        for guidance in (5.0, 0.0):
            tag = f"g{guidance:g}"
            batch = [_request("a", "17", 2, 1, guidance),
                     _request("b", LONG, 2, 2, guidance, num_outputs=1 if guidance else 2,
                              **({"negative_prompt": "a dog"} if guidance else {}))]
            for rid, img in adapter.run_batch(batch).items():
                out[f"request-{tag}/{rid}"] = img
            for rid, img in adapter.run_batch([_request("c", "3", 2, 3, guidance)]).items():
                out[f"request1-{tag}/{rid}"] = img
        steps = [_request("s3", "42", 3, 4, 3.0), _request("s2", "a cat", 2, 5, 0.0, num_outputs=2),
                 _request("s1", LONG, 2, 6, 0.5)]
        for rid, img in checks.run_steps(adapter, steps).items():
            out[f"step/{rid}"] = img
    return out


def transformer_outputs(adapter) -> dict:
    """The transformer called directly on 3 rows (CFG 2: 2 + 1 padded) at 3 timesteps, 8x8 latents (16 image tokens,
    padded to 32): captions of 7, 40 and 3 tokens (unified rows of 64, 96 and 64 tokens: a key mask) and of 5, 9
    and 20 (every row 64 tokens: no mask), as float arrays."""
    import torch

    transformer, out = adapter.denoiser, {}
    gen = torch.Generator().manual_seed(0)
    width = transformer.config.cap_feat_dim
    with torch.inference_mode():
        for name, lengths in (("masked", (7, 40, 3)), ("even", (5, 9, 20))):
            latents = [torch.randn(transformer.config.in_channels, 1, 8, 8, generator=gen) for _ in lengths]
            captions = [torch.randn(n, width, generator=gen) for n in lengths]
            rows = transformer(latents, torch.tensor([0.1, 0.5, 0.9]), captions, return_dict=False)[0]
            out[name] = torch.stack(rows).numpy()
    return out


def installed(denoiser) -> dict:
    """The list CFG wrapper; the Z-Image sequence-parallel processors and their mesh sizes."""
    from stage_runtime.models.families.zimage import ZImageUlyssesAttnProcessor

    sp = [m.processor for m in denoiser.modules() if isinstance(getattr(m, "processor", None),
                                                                ZImageUlyssesAttnProcessor)]
    return {"cfg": getattr(denoiser, "_diffstage_cfg_parallel", None) is not None, "sp": len(sp),
            "ulysses": sorted({p.mesh.ulysses_size for p in sp}), "ring": sorted({p.mesh.ring_size for p in sp})}


def replaced_processor_error(adapter) -> str | None:
    """Put diffusers' own processor back on the first layer: the next call must refuse to run."""
    import torch
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    adapter.denoiser.layers[0].attention.set_processor(ZSingleStreamAttnProcessor())
    try:
        with torch.inference_mode():
            checks.run_steps(adapter, [_request("r", "1", 1, 0, 0.0)])
    except RuntimeError as exc:
        return str(exc)
    return None


def _job_zimage(rank, groups, parallel, run) -> dict:
    from stage_runtime.distributed.apply import apply_parallelism

    adapter = checks.load_adapter(run["path"])
    apply_parallelism(adapter, groups, parallel)
    payload = {"installed": installed(adapter.denoiser)}
    payload["images"], payload["hook-calls"] = checks.counting_denoiser_hooks(adapter, scenarios)
    payload["transformer"] = transformer_outputs(adapter)
    if parallel.sp_size > 1:
        payload["replaced"] = replaced_processor_error(adapter)
    return payload


JOBS = {"zimage": _job_zimage}


def references(path: str) -> dict:
    """One plain rank's images, denoiser call count and direct transformer outputs."""
    adapter = checks.load_adapter(path)
    images, calls = checks.counting_denoiser_hooks(adapter, scenarios)
    return {"images": images, "hook-calls": calls, "transformer": transformer_outputs(adapter)}
