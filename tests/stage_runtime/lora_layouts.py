"""One seeded random PEFT adapter written in each layout LoRA files come in (built locally, no downloads):

    peft       what diffusers' ``save_lora_weights`` writes from a PEFT state dict, with the adapter metadata
               (``<component>.<module>.lora_A.weight``; ``lora_alpha`` / r in the metadata)
    diffusers  diffusers' training-script layout: each component's PEFT state dict through
               ``convert_state_dict_to_diffusers`` (``…attn1.to_k.lora.down.weight``,
               ``…q_proj.lora_linear_layer.up.weight``), then ``save_lora_weights`` — no metadata, so the
               scaling (alpha / r) is folded into lora_B as a trainer saving this layout does
    kohya      kohya / sd-scripts: ``lora_unet_…`` / ``lora_te[12]_…`` with ``.lora_down.weight``,
               ``.lora_up.weight`` and an ``.alpha`` per module (the resnets' convs with another alpha than the
               attention's); SDXL's UNet in kohya's SGM block names (``input_blocks_4_1_…``, ``in_layers_2``),
               FLUX's transformer in BFL's names with the fused ``img_attn_qkv`` / ``txt_attn_qkv``, the text
               encoders with CLIP's ``text_model`` level

The denoiser's targets follow what each layout can carry: PEFT the family's own; the training-script layout the
attention projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``: what the SD training script adapts); kohya on
FLUX the double blocks' attention and the single blocks' ``proj_out`` (kohya's fused ``linear1`` has FLUX.1's
full-size split hard-coded in diffusers).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lora_probes import CLIP_TARGETS, load_pipe, random_adapter, write_adapter
from safetensors.torch import save_file

LAYOUTS = ("peft", "diffusers", "kohya")
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
FLUX_KOHYA = (r"(transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|"
              r"to_add_out))|(single_transformer_blocks\.\d+\.proj_out)")
CONV_ALPHA = 2.0          # kohya's alpha for the UNet resnets' conv1 (the attention's is the adapter's lora_alpha)


def write_layout(layout: str, model_path: str, out_dir: Path, seed: int, rank: int = 4, alpha: float = 8.0,
                 gain: float = 0.3) -> str:
    """The adapter of ``seed`` in ``layout`` → the path to give ``load_lora_weights`` and the stage."""
    if layout == "peft":
        return write_adapter(model_path, out_dir, seed, rank, alpha, gain=gain)
    family = json.loads((Path(model_path) / "model_index.json").read_text())["_class_name"]
    flux, sdxl = family == "FluxPipeline", family == "StableDiffusionXLPipeline"
    encoders = ("text_encoder", "text_encoder_2") if sdxl else ("text_encoder",)
    targets = None                                   # kohya on SD / SDXL: the family's own
    if layout == "diffusers" or flux:
        targets = {"transformer" if flux else "unet": ATTENTION if layout == "diffusers" else FLUX_KOHYA,
                   **{encoder: CLIP_TARGETS for encoder in encoders}}
    cls, layers, _ = random_adapter(model_path, seed, rank, alpha, gain=gain, targets=targets)
    out_dir.mkdir(parents=True, exist_ok=True)
    if layout == "diffusers":
        from diffusers.utils import convert_state_dict_to_diffusers

        folded = {name: {k: v * (alpha / rank) if ".lora_B." in k else v for k, v in state.items()}
                  for name, state in layers.items()}
        cls.save_lora_weights(str(out_dir), **{f"{name}_lora_layers": convert_state_dict_to_diffusers(state)
                                               for name, state in folded.items()})
        return str(out_dir)
    tensors = (_kohya_flux(layers, alpha) if flux
               else _kohya_sd(layers, alpha, sgm=load_pipe(model_path).unet.config if sdxl else None))
    path = out_dir / "kohya_lora.safetensors"
    save_file(tensors, str(path))
    return str(path)


def _modules(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT state dict → module path → (A, B)."""
    paths = sorted({k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")})
    return {p: (state[f"{p}.lora_A.weight"], state[f"{p}.lora_B.weight"]) for p in paths}


def _put(out: dict, name: str, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    out[f"{name}.lora_down.weight"] = a.contiguous()
    out[f"{name}.lora_up.weight"] = b.contiguous()
    out[f"{name}.alpha"] = torch.tensor(float(alpha))


def _encoder_name(component: str, path: str, sdxl: bool) -> str:
    """CLIP's module path as kohya names it: ``lora_te_`` (SD), ``lora_te1_`` / ``lora_te2_`` (SDXL, FLUX)."""
    prefix = {"text_encoder": "lora_te1_" if sdxl else "lora_te_", "text_encoder_2": "lora_te2_"}[component]
    path = path if path.startswith("text_model.") else "text_model." + path
    return prefix + path.replace(".", "_")


def _sgm(path: str, config) -> str:
    """A diffusers UNet module path in SGM block names (the inverse of diffusers' _maybe_map_sgm_blocks_to_diffusers
    and _convert_unet_lora_key): ``down_blocks.1.attentions.0.…`` → ``input_blocks.4.1.…``."""
    per = config.layers_per_block + 1
    parts = path.split(".")
    inner = {"resnets": "0", "attentions": "1"}
    if parts[0] == "down_blocks":
        block = f"input_blocks.{int(parts[1]) * per + int(parts[3]) + 1}.{inner[parts[2]]}"
        rest = parts[4:]
    elif parts[0] == "up_blocks":
        block = f"output_blocks.{int(parts[1]) * per + int(parts[3])}.{inner[parts[2]]}"
        rest = parts[4:]
    else:                                           # mid_block: resnets.0, attentions.0, resnets.1
        block = "middle_block." + {("resnets", "0"): "0", ("attentions", "0"): "1", ("resnets", "1"): "2"}[
            (parts[1], parts[2])]
        rest = parts[3:]
    resnet = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
              "conv_shortcut": "skip_connection"}
    return ".".join([block, *([resnet.get(rest[0], rest[0])] + rest[1:] if rest else [])])


def _kohya_sd(layers: dict, alpha: float, sgm=None) -> dict[str, torch.Tensor]:
    """SD (diffusers' UNet names, as sd-scripts trains SD 1.x) or SDXL (``sgm``: the UNet's config, SGM names)."""
    out: dict[str, torch.Tensor] = {}
    for component, state in layers.items():
        for path, (a, b) in _modules(state).items():
            if component == "unet":
                conv = path.endswith("conv1")
                name = "lora_unet_" + (_sgm(path, sgm) if sgm is not None else path).replace(".", "_")
                _put(out, name, a, b * (alpha / CONV_ALPHA) if conv else b, CONV_ALPHA if conv else alpha)
            else:
                _put(out, _encoder_name(component, path, sgm is not None), a, b, alpha)
    return out


def _kohya_flux(layers: dict, alpha: float) -> dict[str, torch.Tensor]:
    """FLUX.1 in sd-scripts' names: q, k, v fused into one ``qkv`` (A stacked, B block-diagonal, rank 3r, the
    alpha making alpha / 3r the adapter's alpha / r); the rest one to one."""
    out: dict[str, torch.Tensor] = {}
    modules = _modules(layers["transformer"])
    blocks = sorted({int(p.split(".")[1]) for p in modules if p.startswith("transformer_blocks.")})
    for i in blocks:
        for stream, names in (("img", ("to_q", "to_k", "to_v")), ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"))):
            pairs = [modules[f"transformer_blocks.{i}.attn.{n}"] for n in names]
            _put(out, f"lora_unet_double_blocks_{i}_{stream}_attn_qkv", torch.cat([a for a, _ in pairs]),
                 torch.block_diag(*[b for _, b in pairs]), alpha * 3)
        for stream, name in (("img", "to_out.0"), ("txt", "to_add_out")):
            a, b = modules[f"transformer_blocks.{i}.attn.{name}"]
            _put(out, f"lora_unet_double_blocks_{i}_{stream}_attn_proj", a, b, alpha)
    for path, (a, b) in modules.items():
        if path.startswith("single_transformer_blocks."):
            _put(out, f"lora_unet_single_blocks_{path.split('.')[1]}_linear2", a, b, alpha)
    for path, (a, b) in _modules(layers.get("text_encoder", {})).items():
        _put(out, _encoder_name("text_encoder", path, sdxl=True), a, b, alpha)
    return out
