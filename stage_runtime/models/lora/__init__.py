"""LoRA adapters served unfused, per request and per row (docs/lora.md).

files.py reads and checks an adapter file; layer.py is the per-row hook on each adapted module;
manager.py holds one rank's resident adapters. The engine side (names, pinning, max_loras, in-use) is
stage_runtime.engine.lora_table.
"""

from stage_runtime.models.lora.files import LoraWeights, read_lora
from stage_runtime.models.lora.layer import LoraRowsError, RowPlan
from stage_runtime.models.lora.manager import LoraManager

__all__ = ["LoraManager", "LoraRowsError", "LoraWeights", "RowPlan", "read_lora"]
