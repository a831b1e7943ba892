"""What the fork server imports before it forks any rank (``executor.procs.WORKER_PRELOAD``): torch, diffusers
and the runner, once, so that a rank starts as a fork instead of a fresh interpreter.

The server has nothing to clean up: when its parent goes it must go at once, not spend seconds (on a busy
machine) tearing down torch's modules, so its exit skips interpreter finalization. The ranks it forks never run
this hook: a forked rank leaves through ``os._exit`` after its own cleanup (``multiprocessing.forkserver``).
"""

import atexit
import os

import stage_runtime.worker.worker  # noqa: F401  (torch, diffusers, the model runner)

atexit.register(os._exit, 0)
