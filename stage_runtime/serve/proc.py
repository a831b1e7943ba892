"""StageDiffusionProc: the lifecycle of the process each pod runs.

    bind HTTP + ZMQ (state "starting": /health 200, /ready 503 "loading" with the phase)
      → hold the model if it lives in the node cache (stage_runtime.fetch.cache: never evicted while we run)
      → build the engine in a thread: loading_weights (each rank: device check, model load), then warmup
                                                                             failure → exit 2 / 3 / 1
        not ready within --startup-timeout: "StartupTimeout: …" naming the phase, exit 1 at once
      → ready (/ready 200) … until SIGTERM / SIGINT / a ZMQ shutdown, or the engine dies
    SIGTERM: draining (/ready 503, nothing admitted) → in-flight requests finish within --drain-timeout,
             the rest are aborted with a clear error → close the engine → exit 0
    a running step makes no progress for --stall-unready-s: /ready 503 "stalled" (out of the Service) until it
             moves; for --stall-fail-s: the engine fails closed as below, with "StepStalled: …"
    engine dead: termination log "WorkerDied: <reason>", /health 503, in-flight requests fail with
             engine_dead, exit 3 — within DEAD_EXIT_DEADLINE_S of noticing, whatever still runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from stage_runtime.config import StageConfig
from stage_runtime.errors import ConfigError, JobStoreError, StartupTimeoutError
from stage_runtime.fetch.cache import hold, release
from stage_runtime.fetch.archive import folder_bytes
from stage_runtime.jobs.store import open_job_store
from stage_runtime.playground.route import page_url
from stage_runtime.serve.app import build_app
from stage_runtime.serve.auth import load_api_keys
from stage_runtime.jobs.runner import JobRunner
from stage_runtime.serve.metrics import StageMetrics
from stage_runtime.serve.models_route import model_id
from stage_runtime.serve.service import StageService
from stage_runtime.serve.startup import LOADING_WEIGHTS, WARMUP, StartupProgress
from stage_runtime.serve.termination import (EXIT_DEAD, EXIT_OK, exit_code_for, reason_for,
                                             termination_log_path, write_termination_log)
from stage_runtime.serve.zmq_server import ZmqServer

if TYPE_CHECKING:
    from stage_runtime.engine import DiffusionEngine

log = logging.getLogger(__name__)

DEATH_POLL_S = 0.05          # how often the engine's dead latch is checked
DEAD_LINGER_S = 0.8          # after death, keep answering (/health 503, in-flight errors) this long
DEAD_EXIT_DEADLINE_S = 1.8   # …and exit 3 no later than this after noticing, even if closing hangs
HTTP_SHUTDOWN_S = 2.0
# The share of the startup budget left at warm-up that compiling may take (the rest: the eager remainder of the
# warm-up after a timeout, and readiness): past the budget the replica is restarted, compiled or not.
COMPILE_SHARE = 0.8


def build_engine(config: StageConfig, progress: StartupProgress | None = None) -> DiffusionEngine:
    """Load (the ranks: each checks its device, then loads the pipeline), then warm up; `progress` hears each
    phase."""
    progress = progress or StartupProgress()
    progress.enter(LOADING_WEIGHTS, config.model.path)
    try:
        progress.model_bytes = folder_bytes(Path(config.model.path))
    except OSError:
        progress.model_bytes = None           # the loader says what is wrong with the folder
    from stage_runtime.engine import DiffusionEngine

    engine = DiffusionEngine.make_engine(config.model_copy(update={"warmup": False}))
    if config.warmup:
        progress.enter(WARMUP, "one 2-step request" + (
            f", then compiling the denoiser ({config.compile.mode}) at {len(config.compile.shapes) or 1} size(s)"
            if config.compile.enabled else ""))
        try:
            budget = config.server.startup_timeout
            engine.run_warmup(None if budget is None else COMPILE_SHARE * (budget - progress.elapsed()))
        except BaseException:
            engine.close()
            raise
    progress.done()
    return engine


def _hard_exit(code: int, why: str = "shutdown did not finish in time") -> None:
    log.error("%s: exiting %d now", why, code)
    logging.shutdown()
    os._exit(code)


class StageDiffusionProc:
    def __init__(self, config: StageConfig):
        self.config = config
        self.metrics = StageMetrics()
        self.service = StageService(config, self.metrics)
        self.termination_log = termination_log_path(config.server.termination_log)
        self._stop: asyncio.Event | None = None
        self._model_lock: int | None = None       # the cache's in-use lock, held until the process ends
        self.jobs: JobRunner | None = None        # the /v1/videos jobs (--job-store)

    def open_jobs(self) -> JobRunner | None:
        """The job store checked at startup (exit 2 naming the folder or bucket when it cannot be used)."""
        jobs = self.config.jobs
        folder = jobs.store
        if folder is None:
            return None
        try:
            store = open_job_store(folder, jobs.endpoint, jobs.region).open()
        except JobStoreError as exc:
            raise ConfigError(f"--job-store: {exc}") from None
        return JobRunner(self.service, store, self.config.jobs, model_id(self.service))

    def request_stop(self, why: str) -> None:
        if not self._stop.is_set():
            log.info("stop requested (%s): draining for up to %.1f s", why, self.config.server.drain_timeout)
        self._stop.set()

    async def run(self) -> int:
        """Serve until stopped or dead; returns the exit code. Startup failures raise."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        server = self.config.server
        keys = load_api_keys(server.api_key_file) if server.api_key_file else ()
        self.jobs = self.open_jobs()
        runner = web.AppRunner(build_app(self.service, keys, self.jobs), handler_cancellation=True, access_log=None,
                               shutdown_timeout=HTTP_SHUTDOWN_S)
        await runner.setup()
        http_open = True
        zmq_server = ZmqServer(self.service, server.host, server.zmq_port, self.request_stop)
        zmq_task = None
        try:
            await web.TCPSite(runner, server.host, server.http_port).start()
            endpoint = zmq_server.bind()
            host, port = runner.addresses[0][:2]
            log.info("listening http=http://%s:%d zmq=%s", host, port, endpoint)
            if server.playground:
                log.info("playground: open %s in a browser", page_url(host, port))
            zmq_task = asyncio.create_task(zmq_server.serve())
            self._model_lock = hold(self.config.model.path)
            engine = await self._build()
            try:
                return await self._serve(engine)
            finally:
                http_open = False
                await runner.cleanup()                # stop accepting; responses in progress are flushed
                await asyncio.to_thread(engine.close)
        finally:
            if zmq_task is not None:
                zmq_task.cancel()
                await asyncio.gather(zmq_task, return_exceptions=True)
            await zmq_server.close()
            if http_open:
                await runner.cleanup()
            release(self._model_lock)
            self._model_lock = None

    async def _build(self) -> DiffusionEngine:
        """The engine, within the startup budget; past it the termination log names the phase and the process
        exits 1 at once (the build thread cannot be interrupted; the operator restarts the replica)."""
        building = asyncio.ensure_future(asyncio.to_thread(build_engine, self.config, self.service.startup))
        budget = self.config.server.startup_timeout
        if budget is None:
            return await building
        try:
            return await asyncio.wait_for(asyncio.shield(building), max(0.0, budget - self.service.startup.elapsed()))
        except TimeoutError:
            exc = StartupTimeoutError(f"not ready within the startup budget of {budget:g} s (--startup-timeout, "
                                      f"spec.startupTimeoutSeconds): {self.service.startup.describe()}")
            write_termination_log(self.termination_log, reason_for(exc), str(exc))
            print(f"error: {exc}", file=sys.stderr)
            _hard_exit(exit_code_for(exc), "startup timeout")

    async def _serve(self, engine: DiffusionEngine) -> int:
        self.service.attach(engine)
        if self.jobs is not None:
            self.jobs.start()
        log.info("ready: %s executor=%s execution_mode=%s", self.config.parallel.describe(),
                 self.config.resolved_executor, engine.config.scheduler.execution_mode)
        stop = asyncio.create_task(self._stop.wait())
        dead = asyncio.create_task(self._watch_death(engine))
        await asyncio.wait({stop, dead}, return_when=asyncio.FIRST_COMPLETED)
        if not dead.done():
            if self.jobs is not None:
                await self.jobs.hand_off()          # its runs checkpoint and go back to the queue for another replica
            aborted = await self.service.drain(self.config.server.drain_timeout)
            log.info("drained (%d request(s) aborted at the drain timeout)", len(aborted))
            if self.jobs is not None:
                await self.jobs.close()             # its runs were handed off before the drain
        stop.cancel()
        dead.cancel()
        if engine.dead_reason is not None:
            return await self._fail_closed(engine.dead_kind, engine.dead_reason)
        return EXIT_OK

    @staticmethod
    async def _watch_death(engine: DiffusionEngine) -> None:
        while engine.dead_reason is None:
            await asyncio.sleep(DEATH_POLL_S)

    async def _fail_closed(self, kind: str, reason: str) -> int:
        """The engine is dead: say why first (the message must survive a hard exit), answer for a moment, exit 3."""
        write_termination_log(self.termination_log, kind, reason)
        timer = threading.Timer(DEAD_EXIT_DEADLINE_S, _hard_exit, args=(EXIT_DEAD,))
        timer.daemon = True
        timer.start()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self.service.wait_idle(DEAD_LINGER_S)       # in-flight requests get their engine_dead errors
        await asyncio.sleep(max(0.0, DEAD_LINGER_S - (loop.time() - started)))
        return EXIT_DEAD


def serve(config: StageConfig) -> int:
    """Run the stage process to its end; returns the exit code (the termination log is written on failure)."""
    proc = StageDiffusionProc(config)
    try:
        code = asyncio.run(proc.run())
    except Exception as exc:
        code = exit_code_for(exc)
        if code not in (2, 3):
            log.exception("stage failed")
        write_termination_log(proc.termination_log, reason_for(exc), str(exc))
        print(f"error: {exc}", file=sys.stderr)
    if code == EXIT_DEAD:
        # The engine (and with it every worker and shared-memory segment) is closed; interpreter
        # teardown with torch loaded takes seconds, and a dead stage must be gone within 2 s.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_DEAD)
    return code
