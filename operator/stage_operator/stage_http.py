"""The operator's HTTP calls to stage pods (docs/http-api.md): probe `/health` + `/v1/stats`, POST `/v1/abort`.
Short timeouts; a pod that does not answer is reported (never skipped silently)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from stage_operator.health import ProbeResult

_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError)  # ValueError: a body that is not JSON


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _json(response: aiohttp.ClientResponse) -> Any:
    return await response.json(content_type=None)


async def probe(session: aiohttp.ClientSession, base: str, timeout: float) -> ProbeResult:
    """One probe: `/health` (503 → dead with the stage's reason), then the load from `/v1/stats`."""
    at = time.time()
    limit = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(f"{base}/health", timeout=limit) as response:
            if response.status == 503:
                body = await _json(response)
                return ProbeResult(at, dead=str((body.get("error") or {}).get("message") or body))
            if response.status != 200:
                return ProbeResult(at, error=f"/health answered {response.status}")
        async with session.get(f"{base}/v1/stats", timeout=limit) as response:
            if response.status != 200:
                return ProbeResult(at, error=f"/v1/stats answered {response.status}")
            stats = await _json(response)
        startup = stats.get("startup")
        return ProbeResult(at, state=stats.get("state"), waiting=int(stats.get("waiting", 0)),
                           running=int(stats.get("running", 0)), startup=startup if isinstance(startup, dict) else None)
    except _ERRORS as exc:
        return ProbeResult(at, error=_why(exc))


async def _abort_one(session: aiohttp.ClientSession, base: str, body: dict[str, Any],
                     timeout: float) -> dict[str, Any]:
    async with session.post(f"{base}/v1/abort", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        answer = await _json(response)
        if response.status != 200:
            raise aiohttp.ClientResponseError(response.request_info, (), status=response.status, message=str(answer))
        return answer


async def abort(session: aiohttp.ClientSession, targets: Sequence[tuple[str, str | None]],
                request_ids: list[str] | None, timeout: float) -> dict[str, list[str]]:
    """POST the abort to every (pod, url); {aborted, notFound, unreachable} over all of them. An id is not
    found when no pod had it."""
    body: dict[str, Any] = {"all": True} if request_ids is None else {"request_ids": list(request_ids)}
    reachable = [(pod, url) for pod, url in targets if url]
    unreachable = [f"{pod}: no address" for pod, url in targets if not url]
    answers = await asyncio.gather(*(_abort_one(session, url, body, timeout) for _, url in reachable),
                                   return_exceptions=True)
    aborted: list[str] = []
    for (pod, _), answer in zip(reachable, answers, strict=True):
        if isinstance(answer, BaseException):
            if not isinstance(answer, _ERRORS):
                raise answer
            unreachable.append(f"{pod}: {_why(answer)}")
        else:
            aborted += [str(r) for r in answer.get("aborted") or () if str(r) not in aborted]
    not_found = [r for r in request_ids or () if r not in aborted]
    return {"aborted": aborted, "notFound": not_found, "unreachable": unreachable}
