"""Pipeline component names as the config lists them (``offload.components``, ``quantization.components``)."""

from __future__ import annotations

import re

IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


def check_component_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """Each a pipeline attribute name, each once; ValueError naming the first that is not."""
    for name in names:
        if not IDENTIFIER.match(name):
            raise ValueError(f"component names are pipeline attribute names, got {name!r}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"component(s) listed twice: {', '.join(dupes)}")
    return names
