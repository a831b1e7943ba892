"""Model integration: the model families (``families/``, one module per family), the machinery they share (the
adapter base, pipeline registry, step contract, caches, refusals, LoRA) and the tiny built-in models.

Importing this package is cheap: adapters import torch/diffusers only when they are loaded.
"""
