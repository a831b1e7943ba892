"""Lock-step waves for distributed layerwise offload (``offload.mode: distributed`` with all-gather).

Every data-parallel rank holds 1/dp of the denoiser and all of them gather each block together, so every rank must
run the same sequence of denoiser calls at the same time — while each computes its own requests. The scheduler's
capacity is dp × ``max_num_seqs`` (engine) and its compatibility key already keeps one wave to one key (steps, size,
guidance, the family's own fields); here:

- :class:`WavePlacement` puts the wave's requests on the ranks in turn (request ``i`` on rank ``i % dp``); a rank left
  without one runs a *padding* copy of ``req[rank % len(req)]`` (the seed's envelope rule) whose result it drops, so
  it still enters every gather. A single request (the warm-up's) therefore runs on every rank, and needs no special
  case.
- :func:`wave_refusal` is the executor's guard: a wave whose requests differ in that key is refused whole, before
  any rank runs it (the scheduler never builds one; a custom scheduler could).
- :func:`agree_stop` is the per-step cancel agreement: a rank stops its call only when EVERY rank's requests are
  cancelled (one all-reduce per denoising step on the dp group); until then an aborted request's rank keeps
  computing it as padding, and its late result is dropped by the engine, which answered the abort already.
"""

from __future__ import annotations

from stage_runtime.outputs import BatchRunnerOutput
from stage_runtime.scheduler_output import SchedulerOutput


class WavePlacement:
    """The :class:`~stage_runtime.executor.placement.DataParallelPlacement` interface for lock-step waves."""

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self.replica_of: dict[str, int] = {}

    def place(self, sched_out: SchedulerOutput) -> dict[str, int]:
        ids = sched_out.scheduled_request_ids
        self.replica_of = {rid: i % self.num_replicas for i, rid in enumerate(ids)}
        return dict(self.replica_of)

    def pads(self, sched_out: SchedulerOutput) -> dict[int, str]:
        """Replica index → the request it runs as padding (only replicas that got none of their own)."""
        ids = sched_out.scheduled_request_ids
        if not ids:
            return {}
        return {r: ids[r % len(ids)] for r in range(len(ids), self.num_replicas)}

    def release(self, sched_out: SchedulerOutput, out: BatchRunnerOutput) -> None:
        self.replica_of = {}

    def __len__(self) -> int:
        return len(self.replica_of)


def wave_refusal(sched_out: SchedulerOutput) -> str | None:
    """Why the ranks cannot run ``sched_out`` in lock step, or None."""
    if sched_out.mode != "request":
        return f"distributed layerwise offload runs request-mode waves only, not a {sched_out.mode}-mode tick"
    keys = {}
    for new in sched_out.scheduled_new_reqs:
        keys.setdefault(new.request.batch_key, new.request_id)
    if len(keys) > 1:
        shown = "; ".join(f"{rid}: {key}" for key, rid in keys.items())
        return (f"a distributed-layerwise-offload wave must share one forward schedule (steps, size, guidance), "
                f"and these requests differ ({shown}); the ranks would leave each other waiting in a gather")
    if sched_out.scheduled_cached_req_ids:
        return "a distributed-layerwise-offload wave holds new requests only (request mode keeps no state)"
    return None


def agree_stop(groups, cancelled: set[str], request_ids, device=None) -> set[str]:
    """The ids this rank stops now: its cancelled ones when every rank of the dp group has cancelled all of its
    requests, else none (the rank keeps entering the gathers). One all-reduce (MIN) on the dp group."""
    import torch
    import torch.distributed as dist

    from stage_runtime.distributed.comm import guarded

    mine = set(request_ids)
    flag = torch.tensor([1 if mine and mine <= cancelled else 0], dtype=torch.int32, device=device)
    guarded("all_reduce(wave stop)", groups.dp_group,
            lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=groups.dp_group))
    return cancelled & mine if int(flag.item()) else set()
