"""Data-parallel placement inside a stage: which DP replica runs which request.

Each new request goes to the replica with the fewest requests placed on it (ties: the lowest index) and
stays there until it finishes — step mode keeps its state on that replica's ranks. Placement is not
admission or reordering: the scheduler already chose the requests and their order; this only says
where each one runs. Entries leave when a request finishes (request mode: after its one wave).
"""

from __future__ import annotations

from collections import Counter

from stage_runtime.outputs import BatchRunnerOutput
from stage_runtime.scheduler_output import SchedulerOutput


class DataParallelPlacement:
    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self.replica_of: dict[str, int] = {}            # request id → DP replica index

    def place(self, sched_out: SchedulerOutput) -> dict[str, int] | None:
        """Request id → replica for every scheduled request (None with a single replica)."""
        if self.num_replicas == 1:
            return None
        for rid in sched_out.finished_req_ids:
            self.replica_of.pop(rid, None)
        load = Counter(self.replica_of.values())
        for new in sched_out.scheduled_new_reqs:
            replica = min(range(self.num_replicas), key=lambda d: (load[d], d))
            self.replica_of[new.request_id] = replica
            load[replica] += 1
        return {rid: self.replica_of[rid] for rid in sched_out.scheduled_request_ids}

    def release(self, sched_out: SchedulerOutput, out: BatchRunnerOutput) -> None:
        for rid in sched_out.scheduled_request_ids:
            result = out.get(rid)
            if sched_out.mode != "step" or result is None or result.finished or result.error or result.aborted:
                self.replica_of.pop(rid, None)

    def __len__(self) -> int:
        return len(self.replica_of)
