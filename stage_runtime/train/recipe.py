"""Every number of the tiny digits recipe, in one place (the manifest records them next to the digest)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    threads: int = 1                  # torch threads: one (reproducible, and 2 threads on 2 busy cores crawl)
    # the VAE: 32x32 RGB <-> 4x8x8 latents
    vae_steps: int = 500
    vae_batch: int = 32
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-3       # per latent element, against the per-pixel squared error
    # the DiT: 8x8x4 latents, patch 2 (16 tokens), 4 heads
    dit_layers: int = 5
    dit_hidden: int = 64
    dit_steps: int = 4500
    dit_batch: int = 128
    dit_lr: float = 1e-3
    dit_warmup: int = 200
    dit_label_drop: float = 0.1       # the share trained as the null class (classifier-free guidance)
    dit_ema: float = 0.999
    dit_min_snr: float = 5.0          # the loss weight per timestep: min(SNR, this) / SNR
    # the judge: a small CNN on 32x32 grey images
    judge_epochs: int = 15
    judge_batch: int = 64
    judge_lr: float = 2e-3
    judge_shift: int = 2              # random shifts of up to this many pixels (augmentation)
    # the generated score in the manifest: every digit drawn at seeds 0..score_seeds-1
    score_seeds: int = 10

    def as_dict(self) -> dict:
        return asdict(self)
