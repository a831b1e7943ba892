"""`spec.quantization`: how the served weights are stored (the stage config's `quantization:`,
`stage_runtime.config.QuantizationConfig`; docs/quantization.md).

The methods are the runtime's own (`QuantizationMethod`), so the CRD never admits one the stage would refuse at
startup. The fields map onto the stage's `quantization:` section (builders.runtime_config, only when `method` is not
none): method → `method`, components → `components`, skip → `skip`, file → `file`. What CEL cannot check (a skip
pattern is a Python regular expression) the operator's parse does, with the runtime's own checks.
"""

from __future__ import annotations

import re
from typing import Annotated, get_args

from pydantic import ConfigDict, Field, model_validator

from stage_operator.api.base import ApiModel, cel
from stage_runtime.config import QuantizationConfig, QuantizationMethod

_CAMEL = ApiModel.model_config
METHODS: tuple[str, ...] = get_args(QuantizationMethod)
# ASCII only (a Kubernetes pattern's \w is ASCII, Python's is not): never wider than the runtime's identifier check
COMPONENT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
MAX_COMPONENTS = 16
MAX_SKIP = 32
SKIP_MAX_LENGTH = 256
FILE_MAX_LENGTH = 1024

GGUF_NEEDS_FILE = ("quantization.method gguf needs file: the pre-quantized denoiser (.gguf), a path relative to the "
                   "model folder or absolute")
TP_REASON = ("tensor parallel cuts full-precision weights; quantized weights are not sharded (use Ulysses, ring or "
             "CFG parallel)")

_DUPLICATE = "self.components.filter(c, self.components.filter(d, d == c).size() > 1)"
_RULES = [
    cel("self.method != 'gguf' || has(self.file)", f"'{GGUF_NEEDS_FILE}'"),
    cel("!has(self.file) || self.method == 'gguf'",
        "'quantization.file (' + self.file + ') applies only to method gguf, not ' + self.method"),
    cel("self.method != 'gguf' || !has(self.components) || self.components.size() == 0",
        "'quantization.components (' + self.components[0] + ') does not apply to method gguf: the GGUF file is "
        "the denoiser'"),
    cel(f"!has(self.components) || {_DUPLICATE}.size() == 0",
        f"'quantization.components lists ' + {_DUPLICATE}[0] + ' twice: each component is quantized once'"),
]

Component = Annotated[str, Field(pattern=COMPONENT_PATTERN, max_length=64, description=(
    "A pipeline attribute name (e.g. transformer, unet, text_encoder, vae)."))]
SkipPattern = Annotated[str, Field(min_length=1, max_length=SKIP_MAX_LENGTH, description=(
    r"A Python regular expression searched in each module's name (e.g. \.ff\.); a match is kept as loaded."))]


class Quantization(ApiModel):
    """How the served weights are stored (docs/quantization.md). Off (none) by default: the weights as loaded, in
    model.dtype, the exact path and the reference. A quantized stage holds fewer weight bytes at a measured cost in
    quality; /v1/stats.weights and diffstage_weight_bytes say what each component holds. Not with
    parallel.tensorParallelSize > 1 (CEL). Every field is a startup setting: changing one rolls the pods."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": _RULES})
    method: QuantizationMethod = Field("none", description=(
        "none (default): the weights as loaded. fp8-storage: weights stored in float8 (e4m3), cast to model.dtype "
        "layer by layer as each runs; every device, CPU included. int8-weight: int8 weight-only (torchao), computed "
        "in model.dtype; CPU and GPU. fp8: float8 weights and activations (torchao FP8 matmuls); only on GPUs of "
        "compute capability 8.9 or more, refused elsewhere at startup (the stage exits 2 naming the device). gguf: "
        "the denoiser read from a pre-quantized GGUF file (file: Q8_0, Q5_K, Q4_K ...) through diffusers' GGUF "
        "loader, the rest of the pipeline from the model folder; every device."))
    components: list[Component] | None = Field(None, max_length=MAX_COMPONENTS, description=(
        f"The pipeline components quantized, each once (at most {MAX_COMPONENTS}): pipeline attribute names such as "
        "transformer, unet, text_encoder. Default: the denoiser (each part of a routed one, e.g. Wan 2.2's two "
        "experts). Not with method gguf (the file is the denoiser)."))
    skip: list[SkipPattern] | None = Field(None, max_length=MAX_SKIP, description=(
        f"Module-name patterns kept as loaded (at most {MAX_SKIP}, each a Python regular expression of at most "
        f"{SKIP_MAX_LENGTH} characters, searched), on top of what every method keeps: norms, positional and patch "
        "embeddings, the first and last projections."))
    file: str | None = Field(None, min_length=1, max_length=FILE_MAX_LENGTH, description=(
        "method gguf only, and required there: the pre-quantized denoiser (.gguf: Q8_0, Q5_K, Q4_K ...), a path "
        "relative to the model folder the stage serves (e.g. beside it in the same source), or absolute (in the "
        "image or on a podTemplate volume)."))

    @model_validator(mode="after")
    def _runtime_accepts(self) -> Quantization:
        for pattern in self.skip or ():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"quantization.skip {pattern!r} is not a Python regular expression: {exc}") from None
        components = list(self.components or ())
        if twice := [c for c in components if components.count(c) > 1]:
            raise ValueError(f"quantization.components lists {twice[0]} twice: each component is quantized once")
        if self.method == "gguf" and self.file is None:
            raise ValueError(GGUF_NEEDS_FILE)
        if self.file is not None and self.method != "gguf":
            raise ValueError(f"quantization.file ({self.file}) applies only to method gguf, not {self.method}")
        if self.method == "gguf" and components:
            raise ValueError(f"quantization.components ({components[0]}) does not apply to method gguf: the GGUF "
                             "file is the denoiser")
        self.runtime()  # the runtime's own checks (a ValueError naming the field), so the stage never refuses it
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def runtime(self) -> QuantizationConfig:
        """The stage config's `quantization:` section."""
        return QuantizationConfig(method=self.method, components=tuple(self.components or ()),
                                  skip=tuple(self.skip or ()), file=self.file)


def tensor_parallel_refusal(method: str, tensor_parallel_size: int) -> str:
    """The words of the spec-level rule (CEL and the operator's parse): no quantized method with tensor parallel."""
    return (f"quantization.method {method} with parallel.tensorParallelSize {tensor_parallel_size}: {TP_REASON}")


TENSOR_PARALLEL_RULE = cel(
    "!has(self.quantization) || self.quantization.method == 'none' || self.parallel.tensorParallelSize == 1",
    "'quantization.method ' + self.quantization.method + ' with parallel.tensorParallelSize ' + "
    f"string(self.parallel.tensorParallelSize) + ': {TP_REASON}'")
