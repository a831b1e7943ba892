"""A generation request at a sleeping stage (engine.sleep_control): the route awaits :func:`ensure_awake` before it
submits, so the request is served once every rank's weights are back, or answered 503 with Retry-After when the
wake takes longer than ``sleep.wake_timeout_s``. (A job or a ZMQ request needs no route: queuing it starts the wake.)
"""

from __future__ import annotations

import asyncio
import math

from stage_runtime.errors import StageUnavailableError


async def ensure_awake(service) -> None:
    """Before a generation request is submitted: wake a sleeping stage and wait for it (``wake_timeout_s``); past it
    StageUnavailableError (503) with a Retry-After of the last wake's seconds."""
    engine = service.engine
    if engine is None or not engine.sleep.gated:
        return
    if not await asyncio.to_thread(engine.sleep.wait_awake):
        exc = StageUnavailableError(f"the stage is waking from sleep and was not awake within "
                                    f"sleep.wake_timeout_s={engine.sleep.config.wake_timeout_s}; retry")
        exc.retry_after_s = max(1, math.ceil(engine.sleep.last_wake_s or engine.sleep.config.wake_timeout_s))
        raise exc
