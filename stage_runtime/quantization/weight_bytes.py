"""Bytes a module's weights hold, measured on the storages: a quantized tensor subclass (torchao's int8 and float8
tensors, diffusers' GGUF parameters) counts the tensors it is made of (its int8 data and its scales), a float8 storage
one byte an element. Parameters and buffers; a storage shared by two names counts once."""

from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor, seen: set[int]) -> int:
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name), seen) for name in names)
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    try:
        key = data.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):         # a tensor without a plain storage
        return data.numel() * data.element_size()
    if key and key in seen:
        return 0
    seen.add(key)
    return data.numel() * data.element_size()


def module_bytes(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    return sum(tensor_bytes(t, seen) for t in (*module.parameters(), *module.buffers()))
