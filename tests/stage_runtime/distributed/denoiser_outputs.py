"""The denoisers the distributed tests also call directly, as float arrays (their tiny images barely show some
parallel mistakes): one UNet transformer (SD), Wan's experts (2.1, 2.2, TI2V, I2V, VACE), HunyuanVideo-1.5's
transformer. Run on every rank and for the single-rank references (dist_rank_checks imports them)."""

from __future__ import annotations


def transformer_outputs(adapter) -> dict:
    """One UNet Transformer2DModel called directly on 4x4 (16 tokens: sharded under Ulysses 2) and 3x3
    (9 tokens: not divisible, runs unsharded) inputs, as float arrays (SD; Wan: :func:`wan_outputs`)."""
    import torch

    if type(adapter.denoiser).__name__ in ("WanExperts", "WanVACEExperts"):
        return wan_outputs(adapter)
    if type(adapter.denoiser).__name__ == "HunyuanVideo15Transformer3DModel":
        return hunyuan_outputs(adapter)
    if not hasattr(adapter.denoiser, "down_blocks"):
        return {}
    transformer = adapter.denoiser.down_blocks[1].attentions[0]
    gen = torch.Generator().manual_seed(0)
    context = torch.randn(2, 5, adapter.denoiser.config.cross_attention_dim, generator=gen)
    out = {}
    with torch.inference_mode():
        for side in (4, 3):
            hidden = torch.randn(2, transformer.config.in_channels, side, side, generator=gen)
            out[f"{side}x{side}"] = transformer(hidden, encoder_hidden_states=context).sample.numpy()
    return out


def wan_outputs(adapter) -> dict:
    """Wan's denoiser (WanExperts) called directly, as float arrays: the tiny Wan's videos hardly depend on its
    transformer (guidance 5 and 1 differ by 1 uint8), so its parallel equality is checked here too. 3 rows (CFG 2:
    2 + 1 padded) whose timesteps straddle Wan 2.2's expert boundary (both experts in one call; TI2V: a timestep
    per token, each different), at 12 video tokens a row (even chunks), 9 (uneven) and 1 (fewer than the ranks:
    unsharded); I2V: 36 input channels and 5 image tokens before the text in cross-attention; VACE: random control
    latents per row (its 96 channels, the video's grid)."""
    import torch

    config, out = adapter.denoiser.transformer.config, {}
    gen = torch.Generator().manual_seed(0)
    text = torch.randn(3, 7, config.text_dim, generator=gen)
    image = None if config.image_dim is None else torch.randn(3, 5, config.image_dim, generator=gen)   # I2V: CLIP
    steps = torch.tensor([950.0, 600.0, 300.0])
    with torch.inference_mode():
        for frames, height, width in ((3, 4, 4), (3, 2, 6), (1, 2, 2)):
            latents = torch.randn(3, config.in_channels, frames, height, width, generator=gen)
            tokens = frames * height * width // 4
            timestep = steps if not getattr(adapter.pipe.config, "expand_timesteps", False) else \
                steps[:, None] - torch.arange(tokens, dtype=torch.float32) * 10
            inputs = {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": text,
                      "expert_timestep": steps}
            if hasattr(config, "vace_in_channels"):
                inputs["control_hidden_states"] = torch.randn(3, config.vace_in_channels, frames, height, width,
                                                              generator=gen)
            else:
                inputs["encoder_hidden_states_image"] = image
            out[f"{tokens}-tokens"] = adapter.denoiser(**inputs).numpy()
    return out


def hunyuan_outputs(adapter) -> dict:
    """HunyuanVideo-1.5's transformer called directly, as float arrays (its tiny videos barely show guidance, so
    its parallel equality is checked here too): 3 rows (CFG 2: 2 + 1 padded) of different timesteps and context
    masks (Qwen text 7, 4 and 2 tokens of 7; ByT5 glyphs 3, 5 and 0 of 5; 3 zero image tokens, masked out: T2V; I2V
    3 random ones, valid), so 15 context tokens a row (uneven chunks; row 3's second chunk is all padding), at 12
    video tokens a row (even chunks), 9 (uneven) and 1 (fewer than the ranks: unsharded)."""
    import torch

    config, out = adapter.denoiser.config, {}
    gen = torch.Generator().manual_seed(0)

    def valid(counts: list[int], length: int) -> torch.Tensor:
        return (torch.arange(length) < torch.tensor(counts)[:, None]).long()

    context = {"encoder_hidden_states": torch.randn(3, 7, config.text_embed_dim, generator=gen),
               "encoder_attention_mask": valid([7, 4, 2], 7),
               "encoder_hidden_states_2": torch.randn(3, 5, config.text_embed_2_dim, generator=gen),
               "encoder_attention_mask_2": valid([3, 5, 0], 5),
               "image_embeds": torch.randn(3, 3, config.image_embed_dim, generator=gen) if config.task_type == "i2v"
               else torch.zeros(3, 3, config.image_embed_dim)}
    with torch.inference_mode():
        for frames, height, width in ((3, 2, 2), (1, 3, 3), (1, 1, 1)):
            latents = torch.randn(3, config.in_channels, frames, height, width, generator=gen)
            out[f"{frames * height * width}-tokens"] = adapter.denoiser(
                hidden_states=latents, timestep=torch.tensor([950.0, 600.0, 300.0]), **context,
                return_dict=False)[0].numpy()
    return out
