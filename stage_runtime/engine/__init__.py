"""The diffusion engine: admission, the busy loop, output streams, abort, close."""

from stage_runtime.engine.engine import DiffusionEngine
from stage_runtime.engine.stream import RequestStream

__all__ = ["DiffusionEngine", "RequestStream"]
