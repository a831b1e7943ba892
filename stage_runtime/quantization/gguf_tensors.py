"""A GGUF file's tensors against the denoiser it must be (quantization.gguf): read the tensor table without the data,
then check, before diffusers loads anything, what its loader would otherwise fail on with a traceback or load
silently wrong: a file that is no GGUF, a quant type it cannot dequantize, names or shapes that are not the model's
(after diffusers' own conversion of an original-layout file, run here on meta tensors), a quantized tensor where
diffusers computes with plain ones (only linear layers' weights are dequantized on the fly).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from stage_runtime.errors import ConfigError

GGUF_MAGIC = b"GGUF"
PLAIN = ("F32", "F16")              # read as plain tensors; every other type becomes a GGUFParameter


@dataclass(frozen=True)
class FileTensor:
    name: str
    shape: tuple[int, ...]          # the logical shape, in torch's order (GGUF lists the dimensions reversed)
    qtype: str                      # the GGML type's name: F32, Q8_0, Q4_K …

    @property
    def quantized(self) -> bool:
        return self.qtype not in PLAIN


def read_tensors(path: Path, field: str) -> list[FileTensor]:
    """The file's tensor table (names, shapes, types; the data stays on disk), or ConfigError naming ``field``: not a
    GGUF file, or one that does not parse."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConfigError(f"{field}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        return [FileTensor(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name)
                for t in reader.tensors]
    except Exception as exc:                     # a foreign file: whatever the parser trips on, it is the file's fault
        raise ConfigError(f"{field}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def check_quant_types(tensors: list[FileTensor], field: str) -> None:
    """Every tensor's type is one diffusers dequantizes (diffusers.quantizers.gguf.utils), else ConfigError naming
    it."""
    import diffusers
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    readable = [*PLAIN, *(q.name for q in SUPPORTED_GGUF_QUANT_TYPES)]
    for t in tensors:
        if t.qtype not in readable:
            raise ConfigError(f"{field}: tensor {t.name!r} is {t.qtype}, a quant type diffusers "
                              f"{diffusers.__version__} does not read (it reads {', '.join(readable)})")


def match_tensors(denoiser_cls: type, config: dict, mapping_fn, tensors: list[FileTensor], field: str) -> None:
    """The file's tensors are the denoiser's, by name and shape, as diffusers' single-file loader will read them: a file
    whose names are (mostly) the model's is taken as it is and must equal it; any other goes through diffusers'
    converter ``mapping_fn`` (an original-layout file), run here on meta tensors. ConfigError names the first tensor
    that does not fit."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = denoiser_cls.from_config(config)
    expected = model.state_dict()
    cls = denoiser_cls.__name__
    file = {t.name: torch.empty(t.shape, dtype=torch.uint8 if t.quantized else torch.float32, device="meta")
            for t in tensors}
    if 2 * sum(name in expected for name in file) > len(file):
        converted, how = file, ""
    else:
        converted, how = convert(mapping_fn, config, file, cls, field), " after diffusers' conversion"
    for name, tensor in converted.items():
        if name not in expected:
            raise ConfigError(f"{field}: tensor {name!r}{how} is not a weight of {cls} (the model.path's "
                              "denoiser): the file is another model's")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConfigError(f"{field}: tensor {name!r}{how} has shape {tuple(tensor.shape)}, {cls} of the "
                              f"model.path's config has {tuple(expected[name].shape)}: the file is another size's")
    for name, tensor in expected.items():
        if name not in converted:
            raise ConfigError(f"{field}: the file has no tensor{how} for {cls}'s {name!r} {tuple(tensor.shape)}")
    check_quantized_layers(model, converted, field, how)


def convert(mapping_fn, config: dict, file: dict[str, torch.Tensor], cls: str, field: str) -> dict[str, torch.Tensor]:
    try:
        return mapping_fn(checkpoint=dict(file), config=config)
    except KeyError as exc:
        raise ConfigError(f"{field}: the file has no tensor {exc.args[0]!r}, which diffusers' {mapping_fn.__name__} "
                          f"needs to read a {cls} file in its original layout") from None
    except Exception as exc:
        first = ", ".join(repr(name) for name in list(file)[:3])
        raise ConfigError(f"{field}: diffusers' {mapping_fn.__name__} cannot read the file's tensors as {cls} "
                          f"({type(exc).__name__}: {exc}); the file's tensors begin {first}: is it a {cls} "
                          "file?") from None


def check_quantized_layers(model: torch.nn.Module, converted: dict[str, torch.Tensor], field: str, how: str) -> None:
    """diffusers computes with a quantized tensor only as a linear layer's weight (its GGUFLinear), or dequantizes it
    at load inside the model's float32 modules; anywhere else it would be used as raw bytes."""
    modules = dict(model.named_modules())
    kept = set(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    for name, tensor in converted.items():
        if tensor.dtype != torch.uint8 or kept & set(name.split(".")):
            continue
        owner, _, attr = name.rpartition(".")
        if attr != "weight" or not isinstance(modules.get(owner), torch.nn.Linear):
            kind = type(modules.get(owner)).__name__
            raise ConfigError(f"{field}: tensor {name!r}{how} is quantized but is the {attr} of a {kind}; diffusers "
                              "computes with quantized tensors only as linear layers' weights")
