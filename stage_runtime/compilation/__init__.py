"""Compiling the denoiser (``compile:`` in the stage config, stage_runtime/config/compile.py; docs/compile.md).

``install_compiler(adapter, config, device)`` right after the model is loaded: the effective mode (``auto``
resolved from the shipped measurements, compilation.verdicts), the regions (compilation.regions) and the rank's
Compiler (compilation.compiler), or None when nothing is compiled.
"""

from __future__ import annotations

import torch

from stage_runtime.compilation.compiler import Compiler
from stage_runtime.compilation.regions import find_regions, install
from stage_runtime.compilation.verdicts import resolve_auto
from stage_runtime.config import ConfigError, StageConfig

__all__ = ["Compiler", "install_compiler"]


def install_compiler(adapter, config: StageConfig, device: torch.device, rank: int = 0) -> Compiler | None:
    compile_config = config.compile
    if not compile_config.enabled:
        return None
    mode, auto_reason = compile_config.mode, None
    if mode == "auto":
        mode, auto_reason = resolve_auto(type(adapter.pipe).__name__, device.type)
        if mode == "none":
            return Compiler(compile_config, "none", [], device, auto_reason)
    check_offload(adapter, config)
    regions = find_regions(adapter, mode)
    key = f"{config.model.path}|{mode}|{config.parallel.describe()}|rank {rank}"
    compiler = Compiler(compile_config, mode, regions, device, auto_reason, frozenset(adapter.block_holders()), key)
    install(regions, compiler)
    return compiler


def check_offload(adapter, config: StageConfig) -> None:
    """Model offload of the denoiser swaps its weights from hooks on every one of its modules, inside what a compiled
    graph runs: refused, naming the component (the other components may be offloaded)."""
    offload = config.offload
    if offload.mode != "model":
        return
    managed = set(offload.components) or {name for name, value in adapter.pipe.components.items()
                                          if isinstance(value, torch.nn.Module)}
    denoisers = sorted(managed & set(adapter.block_holders()))
    if denoisers:
        raise ConfigError(f"compile.mode={config.compile.mode!r} with offload.mode='model' over the denoiser "
                          f"({', '.join(denoisers)}): the offloader swaps its weights from hooks inside the compiled "
                          "blocks; list only the other components in offload.components (e.g. text_encoder, vae)")
