"""Executors: how the engine reaches its workers (in process, or one process per rank)."""

from stage_runtime.executor.abstract import DiffusionExecutor

__all__ = ["DiffusionExecutor"]
