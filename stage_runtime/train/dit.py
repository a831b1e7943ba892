"""The class-conditional DiT of the digits model, its noise schedule, and its training.

A DiTTransformer2DModel on the VAE's 4x8x8 latents, patch 2 (16 tokens), 4 heads of 16, ``dit_layers`` blocks,
no learned variance (``out_channels == in_channels``: DiTPipeline and the adapter then take the output as the
noise). ``num_embeds_ada_norm`` is 1000 although 10 classes are trained: DiTPipeline (and the engine's DiT
adapter) use class id 1000 as the null class of classifier-free guidance, the extra row of the embedding table.

Training is DDPM's: noise the latents at a uniform timestep of the linear 1000-step schedule, predict the
noise (squared error, weighted per timestep by min(SNR, 5) / SNR: the "min-SNR" weighting, which spends less of
the little training there is on the nearly clean timesteps, and converges faster). A tenth of the labels become
the null class, one draw per sample shared by every block (diffusers' DiT blocks each own a label embedding that
would draw its own: that is turned off). AdamW, warmup then cosine; the weights shipped are the exponential
moving average.
"""

from __future__ import annotations

import copy

import torch

from stage_runtime.train.vae import batches, cosine_lr

NULL_CLASS = 1000           # DiTPipeline's null class for guidance (the embedding table's row 1000)
HEADS = 4


def digits_scheduler():
    """DDIM over the linear DDPM schedule (beta 1e-4 → 0.02, 1000 steps): what training noises with."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(beta_start=0.0001, beta_end=0.02, beta_schedule="linear", clip_sample=False,
                         set_alpha_to_one=False, steps_offset=1)


def digits_dit(layers: int, hidden: int, latent_channels: int = 4, latent_side: int = 8):
    """An untrained DiTTransformer2DModel of the digits layout."""
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(num_attention_heads=HEADS, attention_head_dim=hidden // HEADS,
                                 in_channels=latent_channels, out_channels=latent_channels, num_layers=layers,
                                 sample_size=latent_side, patch_size=2, num_embeds_ada_norm=NULL_CLASS,
                                 norm_type="ada_norm_zero")


def own_label_drop(model) -> None:
    """Turn off the per-block random label drop (the training loop drops labels itself, once per sample)."""
    from diffusers.models.embeddings import LabelEmbedding

    for module in model.modules():
        if isinstance(module, LabelEmbedding):
            module.dropout_prob = 0.0


@torch.no_grad()
def ema_update(ema, model, decay: float) -> None:
    for e, p in zip(ema.parameters(), model.parameters(), strict=True):
        e.mul_(decay).add_(p, alpha=1 - decay)


def train_dit(means: torch.Tensor, stds: torch.Tensor, labels: torch.Tensor, recipe, generator: torch.Generator,
              log=print):
    """Latent posteriors (scaled means and standard deviations, (N, 4, 8, 8)) and labels → the EMA DiT."""
    model = digits_dit(recipe.dit_layers, recipe.dit_hidden, means.shape[1], means.shape[-1])
    own_label_drop(model)
    ema = copy.deepcopy(model)
    model.train()
    scheduler = digits_scheduler()
    steps = scheduler.config.num_train_timesteps
    snr = scheduler.alphas_cumprod / (1 - scheduler.alphas_cumprod)
    weights = snr.clamp(max=recipe.dit_min_snr) / snr
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.dit_lr, weight_decay=0.0)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_lr(s, recipe.dit_steps, recipe.dit_warmup))
    running = 0.0
    for step, idx in enumerate(batches(len(means), recipe.dit_batch, recipe.dit_steps, generator)):
        n = len(idx)
        x0 = means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        t = torch.randint(0, steps, (n,), generator=generator)
        dropped = torch.rand(n, generator=generator) < recipe.dit_label_drop
        y = torch.where(dropped, torch.full_like(labels[idx], NULL_CLASS), labels[idx])
        pred = model(scheduler.add_noise(x0, noise, t), timestep=t, class_labels=y).sample
        loss = torch.mean(weights[t] * torch.mean((pred - noise) ** 2, dim=(1, 2, 3)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lr.step()
        ema_update(ema, model, min(recipe.dit_ema, (1 + step) / (10 + step)))
        running += loss.item()
        if (step + 1) % 500 == 0 or step == recipe.dit_steps - 1:
            log(f"dit step {step + 1:5d}/{recipe.dit_steps}  loss {running / ((step % 500) + 1):.4f}")
            running = 0.0
    ema.eval()
    return ema
