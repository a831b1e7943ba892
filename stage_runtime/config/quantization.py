"""How the served weights are stored (part of :mod:`stage_runtime.config`; the runtime is ``stage_runtime.quantization``).

``method``:

- ``none`` (the default): the weights as loaded, in ``model.dtype``.
- ``fp8-storage``: weights stored in float8 (e4m3), cast to ``model.dtype`` layer by layer as each runs — every
  device, CPU included.
- ``int8-weight``: int8 weight-only (torchao; per output channel for linear layers, per row for embeddings),
  computed in ``model.dtype`` — CPU and GPU.
- ``fp8``: float8 activations and weights (torchao) — only on GPUs that multiply in FP8 (compute capability 8.9 or
  more); refused elsewhere, naming the device.
- ``gguf``: the denoiser read from a pre-quantized GGUF file (``file``: Q8_0, Q5_K, Q4_K …, through diffusers' GGUF
  loader), the rest of the pipeline from the model folder.

``components`` are the pipeline components quantized (empty: the denoiser — each part of a routed one); ``skip``
are module-name patterns (regular expressions, searched) kept as loaded, on top of what every method keeps: norms,
positional and patch embeddings and the first and last projections.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stage_runtime.config.component_names import IDENTIFIER as _IDENTIFIER
from stage_runtime.config.component_names import check_component_names

QuantizationMethod = Literal["none", "fp8-storage", "int8-weight", "fp8", "gguf"]


class QuantizationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    method: QuantizationMethod = "none"
    components: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    file: str | None = Field(None, min_length=1)     # gguf: the .gguf denoiser (relative: inside model.path)

    @field_validator("components")
    @classmethod
    def _names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return check_component_names(v)

    @field_validator("skip")
    @classmethod
    def _patterns(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"skip pattern {pattern!r} is not a regular expression: {exc}") from None
        return v

    @model_validator(mode="after")
    def _file_fits_method(self) -> QuantizationConfig:
        if self.method == "gguf" and self.file is None:
            raise ValueError("method='gguf' needs file: the .gguf denoiser (a path, relative to model.path or absolute)")
        if self.method != "gguf" and self.file is not None:
            raise ValueError(f"file is set but method={self.method!r}; file is the denoiser of method='gguf'")
        if self.method == "gguf" and self.components:
            raise ValueError("components does not apply to method='gguf' (the GGUF file is the denoiser)")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"
