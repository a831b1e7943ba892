"""Parallel topology: the tp-sp-pp-cfg-dp grid of ranks, validated once (part of :mod:`stage_runtime.config`)."""

from __future__ import annotations

import warnings
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

ParallelDim = Literal["tp", "sp", "pp", "cfg", "dp"]
# Rank layout order, fastest-varying first (Megatron-style orthogonal groups): tp-sp-pp-cfg-dp.
_LAYOUT: tuple[str, ...] = ("tp", "sp", "pp", "cfg", "dp")


class RankCoords(NamedTuple):
    """One rank's coordinates in the tp-sp-pp-cfg-dp grid."""

    rank: int
    tp: int
    sp: int
    pp: int
    cfg: int
    dp: int


class ParallelConfig(BaseModel):
    """Parallel topology. Fields hold what the user gave; derived sizes are properties.

    world_size = TP × SP × PP × CFG × DP, with SP = ulysses × ring, and DP inferred from
    ``num_gpus`` (the WORLD) when not given.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    tensor_parallel_size: int = Field(1, ge=1)
    ulysses_degree: int = Field(1, ge=1)
    ring_degree: int = Field(1, ge=1)
    sequence_parallel_size: int | None = Field(None, ge=1)  # derived = ulysses × ring
    cfg_parallel_size: int = Field(1, ge=1, le=2)  # cond / uncond branches
    data_parallel_size: int | None = Field(None, ge=1)  # inferred from num_gpus when None
    pipeline_parallel_size: int = Field(1, ge=1)
    num_gpus: int | None = Field(None, ge=1)  # the WORLD: ranks (GPUs, or CPU processes)

    @model_validator(mode="after")
    def _check_topology(self) -> ParallelConfig:
        # Rule: SP is derived from ulysses × ring; an explicit value must equal exactly that product.
        sp = self.ulysses_degree * self.ring_degree
        if self.sequence_parallel_size is not None and self.sequence_parallel_size != sp:
            raise ValueError(
                f"sequence_parallel_size={self.sequence_parallel_size} does not match "
                f"ulysses_degree({self.ulysses_degree}) × ring_degree({self.ring_degree}) = {sp}")
        # Rule: the WORLD must be divisible by the model-parallel product; DP is the quotient, and an
        # explicit DP must equal it. (PP > 1 only enters this arithmetic; the runtime may refuse it.)
        if self.num_gpus is not None:
            mp = self.model_parallel_size
            if self.num_gpus % mp:
                raise ValueError(f"num_gpus={self.num_gpus} is not divisible by {self._mp_terms()} = {mp}")
            dp = self.num_gpus // mp
            if self.data_parallel_size is not None and self.data_parallel_size != dp:
                raise ValueError(
                    f"data_parallel_size={self.data_parallel_size} does not match the value derived from "
                    f"num_gpus={self.num_gpus} / ({self._mp_terms()} = {mp}) = {dp}")
        # Rule: TP without Ulysses works but usually leaves attention unsharded — warn, don't fail.
        if self.tensor_parallel_size > 1 and self.ulysses_degree == 1:
            warnings.warn(
                f"tensor_parallel_size={self.tensor_parallel_size} with ulysses_degree=1: consider "
                "Ulysses sequence parallelism for attention-heavy DiT models", UserWarning, stacklevel=2)
        return self

    def _mp_terms(self) -> str:
        return (f"tensor_parallel_size({self.tensor_parallel_size}) × sequence_parallel_size({self.sp_size})"
                f" × pipeline_parallel_size({self.pipeline_parallel_size})"
                f" × cfg_parallel_size({self.cfg_parallel_size})")

    @property
    def sp_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.sp_size * self.pipeline_parallel_size * self.cfg_parallel_size

    @property
    def world_size(self) -> int:
        if self.num_gpus is not None:
            return self.num_gpus
        return self.model_parallel_size * (self.data_parallel_size or 1)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.model_parallel_size

    def sizes(self) -> dict[str, int]:
        """Resolved size per dimension, in layout order (tp fastest, dp slowest)."""
        return {"tp": self.tensor_parallel_size, "sp": self.sp_size, "pp": self.pipeline_parallel_size,
                "cfg": self.cfg_parallel_size, "dp": self.dp_size}

    def rank_layout(self) -> list[RankCoords]:
        """Coordinates of every rank: rank = tp + TP*(sp + SP*(pp + PP*(cfg + CFG*dp)))."""
        sizes = self.sizes()
        out = []
        for rank in range(self.world_size):
            rest, coords = rank, []
            for dim in _LAYOUT:
                rest, c = divmod(rest, sizes[dim])
                coords.append(c)
            out.append(RankCoords(rank, *coords))
        return out

    def group_ranks(self, dim: ParallelDim) -> list[list[int]]:
        """Process groups along ``dim``: ranks that differ only in that coordinate, ordered by rank."""
        if dim not in _LAYOUT:
            raise ValueError(f"unknown parallel dimension {dim!r}; expected one of {', '.join(_LAYOUT)}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rc in self.rank_layout():
            key = tuple(getattr(rc, d) for d in _LAYOUT if d != dim)
            groups.setdefault(key, []).append(rc.rank)
        return list(groups.values())

    def describe(self) -> str:
        """One line, e.g. ``world_size=4 (tp=1 sp=1[ulysses=1 ring=1] pp=1 cfg=2 dp=2)``."""
        return (f"world_size={self.world_size} (tp={self.tensor_parallel_size} sp={self.sp_size}"
                f"[ulysses={self.ulysses_degree} ring={self.ring_degree}] pp={self.pipeline_parallel_size}"
                f" cfg={self.cfg_parallel_size} dp={self.dp_size})")
