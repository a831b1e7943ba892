"""Executors for fault injection, loaded through the documented extension point
``executor: "executors_for_tests:Class"`` (the real engine, scheduler, worker and runner run unchanged).

``SentinelWorkerExecutor`` is the in-process executor plus one real child process standing for rank 0's
worker, watched the way the multiprocess executor watches its workers: when the child dies (a test
SIGKILLs the pid that ``/v1/stats`` reports for the rank) the executor latches dead with the reason the
multiprocess executor gives, ``worker rank 0 (pid N) killed by signal 9 (SIGKILL)``. It reports that pid
through ``workers()``, as the multiprocess executor does.

``OutputReadyFirst`` and ``ComputeDoneFirst`` are the multiprocess executor with ranks (``worker_proc_class``) that
hold back one half of a request-mode answer, so the engine sees OUTPUT_READY before COMPUTE_DONE, or the other
way round with time to abort in between; both send every image over 1 KB through shared memory (the real
threshold is 1 MiB; a tiny model's 64×64 image is 12 KB). The ranks import these classes by name: this module
is on the path of the fork server and of every spawned rank (pyproject's ``pythonpath``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from stage_runtime.executor.messages import ComputeDone
from stage_runtime.executor.multiproc import MultiprocExecutor
from stage_runtime.executor.uniproc import UniProcExecutor
from stage_runtime.executor.worker_proc import WorkerProc


class SentinelWorkerExecutor(UniProcExecutor):
    sentinel: subprocess.Popen | None = None

    def _init_executor(self) -> None:
        super()._init_executor()
        self.sentinel = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(3600)"],
                                         stdin=subprocess.DEVNULL)
        threading.Thread(target=self._watch, args=(self.sentinel,), name="sentinel-monitor", daemon=True).start()

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._closed:
            return
        how = f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"
        self.mark_dead(f"worker rank 0 (pid {proc.pid}) {how}")

    def workers(self) -> list[dict]:
        proc = self.sentinel
        return [{"rank": 0, "pid": proc.pid, "alive": proc.poll() is None and not self.is_dead}]

    def _shutdown_workers(self) -> None:
        if self.sentinel is not None and self.sentinel.poll() is None:
            self.sentinel.send_signal(signal.SIGKILL)
            self.sentinel.wait(5)
        super()._shutdown_workers()


class SlowWarmupExecutor(UniProcExecutor):
    """The in-process executor whose warmup wave takes ``WARMUP_S`` (a slow first compile or a cold cache, as
    large models show on real GPUs); every other request runs unchanged."""

    WARMUP_S = 600.0

    def execute_model(self, sched_out):
        if any(n.request_id.startswith("warmup-") for n in sched_out.scheduled_new_reqs):
            import time

            time.sleep(self.WARMUP_S)
        return super().execute_model(sched_out)


class LateComputeDoneProc(WorkerProc):
    """A rank whose COMPUTE_DONE leaves 0.3 s after its images went to the output thread."""

    shm_threshold = 1024
    COMPUTE_DONE_DELAY_S = 0.3

    def _send(self, msg) -> None:
        if isinstance(msg, ComputeDone):
            threading.Event().wait(self.COMPUTE_DONE_DELAY_S)
        super()._send(msg)


class LateOutputReadyProc(WorkerProc):
    """A rank whose output thread packs and sends a batch's images 0.5 s after it got them."""

    shm_threshold = 1024
    OUTPUT_READY_DELAY_S = 0.5

    def _send_outputs(self, images) -> None:
        threading.Event().wait(self.OUTPUT_READY_DELAY_S)
        super()._send_outputs(images)


class OutputReadyFirst(MultiprocExecutor):
    worker_proc_class = LateComputeDoneProc


class ComputeDoneFirst(MultiprocExecutor):
    worker_proc_class = LateOutputReadyProc
