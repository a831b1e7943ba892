"""Parallel execution over torch.distributed: process groups, CFG parallel, Ulysses sequence parallel.

Importing this package imports torch (and diffusers for Ulysses); ``stage_runtime.config`` stays light.
"""

from stage_runtime.distributed.comm import CollectiveError
from stage_runtime.distributed.groups import ParallelGroups, destroy_distributed, init_distributed, single_rank_groups

__all__ = ["CollectiveError", "ParallelGroups", "destroy_distributed", "init_distributed", "single_rank_groups"]
