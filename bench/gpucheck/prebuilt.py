"""Adapters that serve a pipeline built in this process (``model.adapter: gpucheck.prebuilt:Flux``).

Part 3's real-size pipelines are drawn on the device in seconds; saving and loading 24 GB of random weights would
take minutes. The engine's uni executor loads its adapter in this process, so the family's own adapter can wrap
the pipeline already built: ``PIPES[model.path]``. The folder at ``model.path`` is the tiny model's (the engine
reads its tokenizer files); only its weights are not used. Everything else is the family's adapter unchanged.
"""

from __future__ import annotations

from stage_runtime.errors import ModelLoadError
from stage_runtime.models.families.flux import FluxAdapter
from stage_runtime.models.families.sdxl import StableDiffusionXLAdapter
from stage_runtime.models.families.wan import WanAdapter

PIPES: dict[str, object] = {}          # model.path → the pipeline built for it


class Prebuilt:
    @classmethod
    def load(cls, path: str, device, dtype: str = "float32"):
        pipe = PIPES.get(path)
        if pipe is None:
            raise ModelLoadError(f"model.path={path!r}: no pipeline was built for it in this process "
                                 f"(gpucheck.prebuilt.PIPES has {sorted(PIPES)})")
        return cls(pipe, device)


class Flux(Prebuilt, FluxAdapter):
    pass


class Wan(Prebuilt, WanAdapter):
    pass


class SDXL(Prebuilt, StableDiffusionXLAdapter):
    pass
