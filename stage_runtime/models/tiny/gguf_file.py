"""GGUF denoiser files, written with the ``gguf`` package (llama.cpp's gguf-py): a tiny model's denoiser as the
GGUF files people download are made (``make-tiny-model DIR --kind flux --gguf Q8_0``), so ``quantization.method:
gguf`` is tested offline (stage_runtime/quantization/gguf.py reads them through diffusers).

What is quantized follows the published FLUX.1 and Wan GGUF files: the 2-D weights inside the repeated blocks whose
rows split into whole quant blocks; every other tensor (embedders, the final layer, norms, biases, modulation
tables, convolutions) is stored as float32. ``WRITABLE``: the quant types gguf 0.19.0 can write that diffusers
0.42.1 reads. gguf 0.19.0 has no quantizer for the k-quants (Q2_K … Q6_K: NotImplementedError) or the i-quants;
diffusers reads those, but they cannot be made here.
"""

from __future__ import annotations

import json
from pathlib import Path

# Imported without torch, numpy or gguf (the CLI reads WRITABLE for make-tiny-model --gguf's choices).
WRITABLE = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "BF16", "F16", "F32")
DENOISERS = ("transformer", "unet")          # the denoiser component of a pipeline folder, by name
ARCH = {"FluxTransformer2DModel": "flux", "WanTransformer3DModel": "wan"}     # general.architecture, as published


def quantized(name: str, array, block_size: int) -> bool:
    """Whether tensor ``name`` is stored quantized: a 2-D weight of a repeated block with whole quant blocks."""
    return "blocks." in name and name.endswith(".weight") and array.ndim == 2 and array.shape[-1] % block_size == 0


def gguf_file_name(component: str, quant: str) -> str:
    return f"{component}.{quant}.gguf"


def write_gguf(state_dict: dict[str, torch.Tensor], path: str | Path, quant: str = "Q8_0", arch: str = "diffusion",
               also: dict[str, str] | None = None, select=quantized) -> Path:
    """Write ``state_dict`` (already in the file's layout) to ``path``: the tensors ``select(name, array, block_size)``
    picks (default: ``quantized``, the block weights) in ``quant``, the rest float32;
    ``also``: more string metadata. Any quant type gguf can write is accepted (also those diffusers cannot read: the
    refusal tests make such files)."""
    import gguf
    import numpy as np
    import torch

    qtype = gguf.GGMLQuantizationType[quant]
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in (also or {}).items():
        writer.add_string(key, value)
    for name, tensor in state_dict.items():
        array = tensor.detach().to(torch.float32).cpu().numpy()
        if quant == "F16" and select(name, array, block_size):
            writer.add_tensor(name, array.astype(np.float16))
        elif quant not in ("F32", "F16") and select(name, array, block_size):
            writer.add_tensor(name, gguf.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def denoiser_component(folder: str | Path) -> tuple[str, str]:
    """(component name, diffusers class name) of the pipeline folder's denoiser, from its model_index.json."""
    index = json.loads((Path(folder) / "model_index.json").read_text())
    for name in DENOISERS:
        entry = index.get(name)
        if isinstance(entry, list) and entry[-1] is not None:
            return name, entry[-1]
    raise ValueError(f"{folder}: model_index.json names no denoiser ({' or '.join(DENOISERS)})")


def write_folder_gguf(folder: str | Path, quant: str = "Q8_0", layout: str | None = None,
                      out: str | Path | None = None) -> Path:
    """The pipeline folder's denoiser as a GGUF file (default: ``<folder>/<component>.<quant>.gguf``, beside its
    component folders, where ``quantization.file: <component>.<quant>.gguf`` finds it). ``layout``: the file's key
    layout (gguf_layouts; default: ``TINY_LAYOUT``, else diffusers')."""
    import diffusers

    from stage_runtime.models.tiny.gguf_layouts import TINY_LAYOUT, to_layout

    if quant not in WRITABLE:
        raise ValueError(f"--gguf {quant}: this writer makes {', '.join(WRITABLE)} (gguf's quantizers that diffusers "
                         "reads; gguf 0.19.0 cannot write the k-quants)")
    component, class_name = denoiser_component(folder)
    model = getattr(diffusers, class_name).from_pretrained(folder, subfolder=component, local_files_only=True)
    layout = layout or TINY_LAYOUT.get(class_name, "diffusers")
    state = to_layout(class_name, model.state_dict(), layout)
    target = Path(out) if out is not None else Path(folder) / gguf_file_name(component, quant)
    return write_gguf(state, target, quant, arch=ARCH.get(class_name, "diffusion"),
                      also={"diffstage.layout": layout, "diffstage.class": class_name})
