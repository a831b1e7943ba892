"""Model integration: pipeline registry, adapters over diffusers pipelines, tiny built-in models.

Importing this package is cheap: adapters import torch/diffusers only when they are loaded.
"""
