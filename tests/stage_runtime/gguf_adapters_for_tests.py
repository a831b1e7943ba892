"""The FLUX.1 and Wan adapters with their denoiser read from the model folder's GGUF file through
``quantization.gguf.load_gguf_pipeline``, named by the ``model.adapter`` plugin path: the real engine serves a GGUF
denoiser before the model runner calls the loader itself for ``quantization.method: gguf``. The families' own
classes run unchanged; only where the denoiser comes from differs.
"""

from __future__ import annotations

from stage_runtime.config import ModelConfig, QuantizationConfig
from stage_runtime.models.flux import FluxAdapter
from stage_runtime.models.wan import WanAdapter
from stage_runtime.quantization.gguf import load_gguf_pipeline

GGUF_FILE = "transformer.Q8_0.gguf"          # make-tiny-model --gguf Q8_0 writes it inside the folder


class _GgufLoad:
    @classmethod
    def load(cls, path, device, dtype="float32", **components):
        if components:                       # load_gguf_pipeline's own call, with the GGUF denoiser
            return super().load(path, device, dtype, **components)
        return load_gguf_pipeline(cls, ModelConfig(path=path, dtype=dtype),
                                  QuantizationConfig(method="gguf", file=GGUF_FILE), device)


class GgufFluxAdapter(_GgufLoad, FluxAdapter):
    pass


class GgufWanAdapter(_GgufLoad, WanAdapter):
    pass
