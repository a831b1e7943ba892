"""One rank's view of the parallel topology: torch.distributed init and the process groups it uses.

The layout comes only from :class:`stage_runtime.config.ParallelConfig` (tp-sp-pp-cfg-dp, tp fastest).
E.g. world 4 with cfg=2, dp=2::

    rank  tp sp pp cfg dp     cfg groups   replicas (one model copy each)
      0    0  0  0  0   0     [0, 1]       [0, 1]  leader 0
      1    0  0  0  1   0
      2    0  0  0  0   1     [2, 3]       [2, 3]  leader 2
      3    0  0  0  1   1

``new_group`` is collective over the whole world, so every rank creates every group of every
dimension in the same order, and keeps the ones it belongs to. A dimension of size 1 gets no group
(None). A world of one rank never touches torch.distributed (:func:`single_rank_groups`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from stage_runtime.config import ParallelConfig, RankCoords
from stage_runtime.distributed.comm import CollectiveError, guarded

log = logging.getLogger(__name__)

__all__ = ["CollectiveError", "ParallelGroups", "destroy_distributed", "init_distributed", "single_rank_groups"]


@dataclass
class ParallelGroups:
    """One rank's view of the topology (groups are None where their dimension has size 1)."""

    rank: int
    world_size: int
    coords: RankCoords
    cfg_group: ProcessGroup | None = None      # ranks differing only in the cfg coordinate
    sp_group: ProcessGroup | None = None       # sequence-parallel group: ranks differing only in the sp coordinate
    tp_group: ProcessGroup | None = None       # tensor-parallel group: ranks differing only in the tp coordinate
    # Inside the sp group (sp = u + ulysses_degree·r): Ulysses over u (same r), ring over r (same u).
    # With ring_degree 1 the Ulysses group IS the sp group; with ulysses_degree 1 the ring group is.
    ulysses_group: ProcessGroup | None = None
    ring_group: ProcessGroup | None = None
    replica_group: ProcessGroup | None = None  # all ranks sharing my dp coordinate (one model copy)
    replica_ranks: list[int] = field(default_factory=list)  # my replica's global ranks, ascending (leader first)
    dp_group: ProcessGroup | None = None       # ranks differing only in the dp coordinate (DLO's gathers)
    num_replicas: int = 1                      # the DP size

    def __post_init__(self) -> None:
        if not self.replica_ranks:
            self.replica_ranks = [self.rank]

    @property
    def is_replica_leader(self) -> bool:
        """The rank that replies for its replica: every model-parallel coordinate is 0."""
        c = self.coords
        return c.tp == c.sp == c.pp == c.cfg == 0

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def dp_size(self) -> int:
        return self.num_replicas


def single_rank_groups() -> ParallelGroups:
    """World of one: no torch.distributed initialisation at all."""
    return ParallelGroups(rank=0, world_size=1, coords=RankCoords(0, 0, 0, 0, 0, 0))


def _replicas(parallel: ParallelConfig) -> list[list[int]]:
    """Ranks per dp coordinate, dp 0 first (each list ascending)."""
    by_dp: dict[int, list[int]] = {}
    for rc in parallel.rank_layout():
        by_dp.setdefault(rc.dp, []).append(rc.rank)
    return [by_dp[dp] for dp in sorted(by_dp)]


def init_distributed(parallel: ParallelConfig, rank: int, init_method: str, device: torch.device,
                     timeout_s: float, backend: str | None = None) -> ParallelGroups:
    """Join the world (gloo on CPU, NCCL on CUDA) and create the cfg, sp, replica, tp, dp, ulysses and ring groups.

    Collective: every rank of the world must call it with the same ``parallel``, ``init_method`` and ``backend``.
    ``backend`` overrides the device's default: ``"gloo"`` with CUDA tensors lets several ranks share one GPU, where
    NCCL may refuse two ranks on one device (``bench/gpu_check.py`` tries both). Failures (a peer that never shows
    up within ``timeout_s``, a refused rendezvous) raise :class:`CollectiveError`.
    """
    world = parallel.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside world_size={world}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: expected 'gloo', 'nccl' or None (the device's default)")
    if world == 1:
        return single_rank_groups()
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    guarded(f"init_process_group({backend}, {init_method})", None, lambda: dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout))

    def mine(groups: list[list[int]], label: str) -> ProcessGroup | None:
        """Create every group of a dimension (same order on all ranks); return the one holding ``rank``."""
        found = None
        for ranks in groups:
            if len(ranks) < 2:
                continue
            group = guarded(f"new_group({label} {ranks})", None,
                            lambda r=ranks: dist.new_group(ranks=r, timeout=timeout, backend=backend))
            if rank in ranks:
                found = group
        return found

    try:
        cfg_group = mine(parallel.group_ranks("cfg"), "cfg")
        sp_group = mine(parallel.group_ranks("sp"), "sp")
        replicas = _replicas(parallel)
        replica_group = mine(replicas, "replica")
        tp_group = mine(parallel.group_ranks("tp"), "tp")
        dp_group = mine(parallel.group_ranks("dp"), "dp")
        ulysses_group, ring_group = _sp_subgroups(parallel, sp_group, mine)
    except BaseException:
        destroy_distributed()
        raise
    coords = parallel.rank_layout()[rank]
    return ParallelGroups(rank=rank, world_size=world, coords=coords, cfg_group=cfg_group, sp_group=sp_group,
                          replica_group=replica_group, replica_ranks=list(replicas[coords.dp]),
                          num_replicas=parallel.dp_size, tp_group=tp_group, ulysses_group=ulysses_group,
                          ring_group=ring_group, dp_group=dp_group)


def sp_subgroup_ranks(parallel: ParallelConfig) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups): each sp group (ranks in sp order) cut into runs of ``ulysses_degree``
    consecutive members (Ulysses inside) and strided by it (ring across). E.g. ulysses 2 × ring 2::

        sp group [0, 1, 2, 3]    ulysses [0, 1] [2, 3]    ring [0, 2] [1, 3]
    """
    u, ulysses, ring = parallel.ulysses_degree, [], []
    for ranks in parallel.group_ranks("sp"):
        ulysses += [ranks[i:i + u] for i in range(0, len(ranks), u)]
        ring += [ranks[j::u] for j in range(u)]
    return ulysses, ring


def _sp_subgroups(parallel: ParallelConfig, sp_group, mine):
    if parallel.ring_degree == 1:
        return sp_group, None
    if parallel.ulysses_degree == 1:
        return None, sp_group
    ulysses, ring = sp_subgroup_ranks(parallel)
    return mine(ulysses, "ulysses"), mine(ring, "ring")


def destroy_distributed() -> None:
    """Tear down every process group; idempotent and safe when never initialised."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - teardown of a dead group must not mask the original failure
            log.debug("destroy_process_group failed: %r", exc)
