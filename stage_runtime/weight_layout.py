"""What a model folder's denoiser weighs, block by block, read from its safetensors headers (no torch, nothing
loaded): ``stage-runtime validate`` prints from it how distributed layerwise offload would shard the denoiser.

The split follows the offloader's (stage_runtime.offload.plan): each block of the block lists (``down_blocks.N``,
``mid_block``, ``up_blocks.N``, ``transformer_blocks.N``, ``single_transformer_blocks.N``, ``blocks.N``) is a unit, and
everything else of the component is its ``head``; each unit is padded as the gather tier pads it (ALIGN × dp).
A family that declares other block lists is split by the runtime as it declares; this reading is the default's.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

ALIGN = 64                      # must equal stage_runtime.offload.gather.ALIGN (a test holds them equal)
_BLOCK = re.compile(r"^((?:down_blocks|up_blocks|transformer_blocks|single_transformer_blocks|blocks)\.\d+|mid_block)\.")
_DENOISERS = ("transformer", "transformer_2", "unet", "transformer_3d")


@dataclass(frozen=True)
class ComponentLayout:
    name: str
    units: dict[str, int]              # unit name ("head", "transformer_blocks.3") → bytes

    @property
    def nbytes(self) -> int:
        return sum(self.units.values())

    def shard_bytes(self, world: int) -> int:
        """What one rank keeps of this component at rest: 1/world of each unit, padded as the tier pads it."""
        return sum(-(-max(n, 1) // (ALIGN * world)) * ALIGN for n in self.units.values())

    def window_bytes(self) -> int:
        """The gathered copies a rank holds at once while the component runs: its head + the two largest blocks
        (the running block and the one prefetched)."""
        blocks = sorted((n for name, n in self.units.items() if name != "head"), reverse=True)
        return self.units.get("head", 0) + sum(blocks[:2])


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def component_layout(folder: Path, name: str) -> ComponentLayout | None:
    files = sorted((folder / name).glob("*.safetensors"))
    if not files:
        return None
    units: dict[str, int] = {}
    for path in files:
        for key, info in _header(path).items():
            if key == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            m = _BLOCK.match(key)
            unit = m.group(1) if m else "head"
            units[unit] = units.get(unit, 0) + end - begin
    return ComponentLayout(name, units)


def denoiser_layouts(model_path: str) -> list[ComponentLayout]:
    """The denoiser components of a diffusers folder (both of Wan 2.2's experts), or [] when it cannot be read."""
    folder = Path(model_path)
    try:
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    out = []
    for name in _DENOISERS:
        entry = index.get(name)
        if isinstance(entry, list) and entry and entry[0] is not None:
            layout = component_layout(folder, name)
            if layout is not None:
                out.append(layout)
    return out


def describe_dlo(model_path: str, world: int) -> list[str]:
    """``validate``'s lines for distributed layerwise offload over ``world`` data-parallel ranks."""
    layouts = denoiser_layouts(model_path)
    if not layouts:
        return [f"  each rank keeps 1/{world} of each denoiser block and of its head; give --model FOLDER to see "
                "the bytes"]
    lines = []
    for c in layouts:
        blocks = len(c.units) - ("head" in c.units)
        shard = c.shard_bytes(world)
        lines.append(f"  {c.name}: {c.nbytes:,} bytes in {len(c.units)} units (head + {blocks} blocks)")
        lines += [f"    dp rank {r}: {shard:,} bytes at rest ({shard / max(c.nbytes, 1):.2f}× of a full copy) "
                  f"+ up to {c.window_bytes():,} bytes gathered while it runs" for r in range(world)]
    return lines
