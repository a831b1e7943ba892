"""LTX2Pipeline (LTX-2, video with sound): its ``FAMILY`` row in the checklist (test_families.py)."""

from __future__ import annotations

import torch
from family_checks import Family

torch.set_num_threads(1)
FAMILY = Family("ltx2", guidances=(3.0, 5.0), size=64, frames=9)
