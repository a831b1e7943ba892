"""The tiny AutoencoderKL of the digits model, and its training.

Three 16/32/32-channel levels: 32x32 RGB pixels ↔ 4x8x8 latents (downsampling 4: the latents have the
digits' native 8x8 grid). Trained as a VAE (squared error + a small KL term, the reparameterised sample
drawn from a seeded generator); then ``scaling_factor`` is set so the training latents have unit standard
deviation, as DiTPipeline expects (it divides by it before decoding).
"""

from __future__ import annotations

import math

import torch

LATENT_CHANNELS = 4


def digits_vae():
    """An untrained AutoencoderKL of the digits layout."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                         up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                         layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=32)


def cosine_lr(step: int, steps: int, warmup: int) -> float:
    """The learning-rate factor: linear warmup, then a cosine down to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def batches(n: int, batch: int, steps: int, generator: torch.Generator):
    """``steps`` index batches over ``n`` items, epoch after epoch of seeded permutations."""
    order, at = torch.randperm(n, generator=generator), 0
    for _ in range(steps):
        if at + batch > n:
            order, at = torch.randperm(n, generator=generator), 0
        yield order[at:at + batch]
        at += batch


def train_vae(pixels: torch.Tensor, recipe, generator: torch.Generator, log=print):
    """``pixels`` (N, 3, 32, 32) in [-1, 1] → the trained VAE (its ``scaling_factor`` set)."""
    vae = digits_vae()
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=recipe.vae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_lr(s, recipe.vae_steps, 50))
    latent_elements = LATENT_CHANNELS * (pixels.shape[-1] // 4) ** 2
    for step, idx in enumerate(batches(len(pixels), recipe.vae_batch, recipe.vae_steps, generator)):
        x = pixels[idx]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator=generator)).sample
        mse = torch.mean((recon - x) ** 2)
        kl = posterior.kl().mean() / latent_elements
        loss = mse + recipe.vae_kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0 or step == recipe.vae_steps - 1:
            log(f"vae step {step:5d}/{recipe.vae_steps}  mse {mse.item():.5f}  kl {kl.item():.4f}")
    vae.eval()
    with torch.no_grad():
        means = torch.cat([vae.encode(pixels[i:i + 256]).latent_dist.mean for i in range(0, len(pixels), 256)])
    vae.register_to_config(scaling_factor=float(1.0 / means.std()))
    return vae


@torch.no_grad()
def encode_all(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled posterior mean and standard deviation of every image (the DiT samples from them)."""
    means, stds = [], []
    for i in range(0, len(pixels), 256):
        dist = vae.encode(pixels[i:i + 256]).latent_dist
        means.append(dist.mean)
        stds.append(dist.std)
    scale = vae.config.scaling_factor
    return torch.cat(means) * scale, torch.cat(stds) * scale


@torch.no_grad()
def reconstruction_error(vae, pixels: torch.Tensor) -> float:
    """Mean absolute error (in [0, 1] units) of decoding the posterior means: how clean the VAE draws."""
    total = 0.0
    for i in range(0, len(pixels), 256):
        x = pixels[i:i + 256]
        recon = vae.decode(vae.encode(x).latent_dist.mean).sample.clamp(-1, 1)
        total += float((recon - x).abs().sum() / 2)
    return total / pixels.numel()
