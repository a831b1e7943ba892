"""diffstage operator: reconciles DiffusionStage resources into stage pods (kopf).

Imports nothing from the runtime but ``stage_runtime.config`` and never imports torch.
"""

__version__ = "0.1.0"
