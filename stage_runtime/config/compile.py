"""How the denoiser is compiled (part of :mod:`stage_runtime.config`; the runtime is ``stage_runtime.compilation``).

``mode``:

- ``none`` (the default): eager, bitwise what the bare diffusers pipeline computes.
- ``regional``: each repeated block class of the denoiser (the model's ``_repeated_blocks``, else the family's
  ``compile_blocks``) is compiled once and shared by every block of that class: compile time does not grow with
  depth.
- ``full``: the denoiser's whole ``forward``.
- ``auto``: the mode the shipped measurements found faster for this family on this kind of device
  (``stage_runtime/compilation/verdicts.json``, written by ``bench/compile.py``), else ``none``.

``shapes`` are the output sizes compiled at warm-up (``WIDTHxHEIGHT``, ``WIDTHxHEIGHTxFRAMES`` for video, as a
request's ``size``); empty: the model's default size. ``max_graphs`` bounds the graphs a rank compiles: past it a
call that would need a new graph runs eagerly instead (never a recompile storm). ``timeout_s`` bounds the warm-up's
compiling: past it the stage serves eagerly and says so. ``cache_dir`` holds the compiled artifacts (inductor's and
AOTAutograd's caches), so a restarted process on the same node compiles warm; None: torch's default folder.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

CompileMode = Literal["none", "auto", "regional", "full"]
SHAPE_PATTERN = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})(?:x([1-9][0-9]{0,4}))?$")
MAX_SHAPES = 16


def parse_shape(shape: str) -> tuple[int, int, int | None]:
    """``"64x48"`` → (width 64, height 48, None); ``"32x32x17"`` → (32, 32, 17 frames)."""
    match = SHAPE_PATTERN.match(shape)
    if match is None:
        raise ValueError(f"compile shape {shape!r} must be WIDTHxHEIGHT or WIDTHxHEIGHTxFRAMES (e.g. 1024x1024, "
                         "832x480x81)")
    width, height, frames = match.groups()
    return int(width), int(height), None if frames is None else int(frames)


class CompileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: CompileMode = "none"
    cache_dir: str | None = Field(None, min_length=1)
    shapes: tuple[str, ...] = ()
    max_graphs: int = Field(64, ge=1, le=4096)
    timeout_s: float = Field(900.0, gt=0, le=86400, allow_inf_nan=False)

    @field_validator("shapes")
    @classmethod
    def _shapes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > MAX_SHAPES:
            raise ValueError(f"at most {MAX_SHAPES} compile shapes, got {len(v)}")
        for shape in v:
            parse_shape(shape)
        dupes = sorted({s for s in v if v.count(s) > 1})
        if dupes:
            raise ValueError(f"compile shape(s) listed twice: {', '.join(dupes)}")
        return v

    @property
    def enabled(self) -> bool:
        return self.mode != "none"
