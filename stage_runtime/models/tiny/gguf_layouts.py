"""The key layouts of GGUF denoiser files, from a diffusers state dict: the inverse of diffusers' single-file converters
(``diffusers/loaders/single_file_utils.py``), so a file written here is read the way a downloaded one is.

- ``diffusers``: the model's own state dict keys. diffusers' single-file loader takes a file whose keys equal the
  model's as it is, without converting (``_should_convert_state_dict_to_diffusers``).
- ``original``: the keys of the checkpoints the GGUF files people download were made from, which diffusers converts
  on load — FLUX.1: Black Forest Labs' layout (``double_blocks.N.img_attn.qkv`` …, q/k/v fused, the final
  modulation's shift and scale swapped; the inverse of ``convert_flux_transformer_checkpoint_to_diffusers``); Wan
  2.1: Wan-AI's layout (``blocks.N.self_attn.q`` …, renames only; of ``convert_wan_transformer_to_diffusers``).

diffusers 0.42.1's FLUX.1 converter splits the fused tensors at FLUX.1's own width (3072, MLP ratio 4): a FLUX.1
file in the original layout loads only at that width, so the tiny FLUX.1 (width 32) is written in the diffusers
layout (``TINY_LAYOUT``), and the original one is checked against diffusers' converter at FLUX.1's width.
"""

from __future__ import annotations

import re

import torch

LAYOUTS = ("diffusers", "original")


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """[a; b] → [b; a] along rows: FLUX.1's final modulation is (shift, scale) in BFL's layout, (scale, shift) in
    diffusers' (its own inverse)."""
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _take(sd: dict, out: dict, pairs: dict[str, str]) -> None:
    """Move ``sd[diffusers + suffix]`` to ``out[original + suffix]`` for the weight and bias of each pair present."""
    for theirs, ours in pairs.items():
        for suffix in (".weight", ".bias"):
            if theirs + suffix in sd:
                out[ours + suffix] = sd.pop(theirs + suffix)


def _fuse(sd: dict, out: dict, parts: list[str], fused: str) -> None:
    for suffix in (".weight", ".bias"):
        out[fused + suffix] = torch.cat([sd.pop(p + suffix) for p in parts], dim=0)


def flux_original(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FluxTransformer2DModel's state dict in Black Forest Labs' FLUX.1 layout."""
    sd, out = dict(state_dict), {}
    _take(sd, out, {"time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
                    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
                    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
                    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
                    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
                    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
                    "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"})
    for suffix in (".weight", ".bias"):
        out["final_layer.adaLN_modulation.1" + suffix] = swap_halves(sd.pop("norm_out.linear" + suffix))
    doubles = sorted({int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks.")})
    for i in doubles:
        d, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        _fuse(sd, out, [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"], o + "img_attn.qkv")
        _fuse(sd, out, [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"], o + "txt_attn.qkv")
        _take(sd, out, {d + "norm1.linear": o + "img_mod.lin", d + "norm1_context.linear": o + "txt_mod.lin",
                        d + "attn.to_out.0": o + "img_attn.proj", d + "attn.to_add_out": o + "txt_attn.proj",
                        d + "ff.net.0.proj": o + "img_mlp.0", d + "ff.net.2": o + "img_mlp.2",
                        d + "ff_context.net.0.proj": o + "txt_mlp.0", d + "ff_context.net.2": o + "txt_mlp.2"})
        for theirs, ours in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                             ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):
            out[o + ours + ".scale"] = sd.pop(f"{d}attn.{theirs}.weight")
    singles = sorted({int(k.split(".")[1]) for k in sd if k.startswith("single_transformer_blocks.")})
    for i in singles:
        d, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        _fuse(sd, out, [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"], o + "linear1")
        _take(sd, out, {d + "norm.linear": o + "modulation.lin", d + "proj_out": o + "linear2"})
        out[o + "norm.query_norm.scale"] = sd.pop(d + "attn.norm_q.weight")
        out[o + "norm.key_norm.scale"] = sd.pop(d + "attn.norm_k.weight")
    if sd:
        raise ValueError(f"FLUX.1 layout: no original name for {sorted(sd)[0]!r} (and {len(sd) - 1} more)")
    return out


# Wan 2.1, diffusers → Wan-AI: applied in order to each key (a block's norm2 is Wan-AI's norm3).
WAN_RENAMES = (
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"\.attn1\.", ".self_attn."), (r"\.attn2\.", ".cross_attn."),
    (r"\.to_q\.", ".q."), (r"\.to_k\.", ".k."), (r"\.to_v\.", ".v."), (r"\.to_out\.0\.", ".o."),
    (r"\.scale_shift_table$", ".modulation"),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."), (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"\.norm2\.", ".norm3."),
)


def wan_original(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """WanTransformer3DModel's (Wan 2.1 text-to-video) state dict in Wan-AI's layout."""
    out = {}
    for key, value in state_dict.items():
        for pattern, repl in WAN_RENAMES:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out


ORIGINAL = {"FluxTransformer2DModel": flux_original, "WanTransformer3DModel": wan_original}
# The layout the tiny models' files are written in: the original one where diffusers reads it at the tiny width.
TINY_LAYOUT = {"FluxTransformer2DModel": "diffusers", "WanTransformer3DModel": "original"}


def to_layout(class_name: str, state_dict: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """``state_dict`` (the diffusers model ``class_name``'s) with the keys of ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")
    if layout == "diffusers":
        return dict(state_dict)
    if class_name not in ORIGINAL:
        raise ValueError(f"no original layout known for {class_name}; known: {', '.join(ORIGINAL)}")
    return ORIGINAL[class_name](state_dict)
