"""The stage's startup LoRA adapters as configured (``loras:`` in stage.yaml, ``--lora NAME=PATH``, the CRD's
``spec.loras``); re-exported by stage_runtime.config. No torch: the operator and the edge import it."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo

LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"     # a LoRA adapter's name (requests, CRD, CLI)


class LoraSpec(BaseModel):
    """A startup LoRA adapter: the name requests use, its file (or folder) inside the stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=LORA_NAME_PATTERN)
    path: str = Field(min_length=1)
    pinned: bool = True             # startup adapters are pinned: never evicted for max_loras


def _fit(loras: tuple[LoraSpec, ...], info: ValidationInfo) -> tuple[LoraSpec, ...]:
    names, bound = [spec.name for spec in loras], info.data.get("max_loras", 8)
    if len(set(names)) != len(names):
        raise ValueError(f"names must be distinct, got {names}")
    if len(names) > bound:
        raise ValueError(f"{len(names)} startup adapters but max_loras={bound}")
    return loras


StartupLoras = Annotated[tuple[LoraSpec, ...], AfterValidator(_fit)]
