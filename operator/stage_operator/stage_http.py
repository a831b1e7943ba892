"""The operator's HTTP calls to stage pods (docs/http-api.md): probe `/health` + `/v1/stats`, POST `/v1/abort`.
Short timeouts; a pod that does not answer is reported (never skipped silently). With `spec.auth` the `/v1/*`
calls carry `Authorization: Bearer <key>` (the first key of the stage's Secret); `/health` stays open. A 401
from `/v1/stats` (no key or a wrong one) leaves the pod healthy with no load known: a wrong key is a
configuration problem to report, never a reason to restart a pod that answers `/health`."""

from __future__ import annotations

import asyncio
import time
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from stage_operator.health import ProbeResult

log = logging.getLogger(__name__)
_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError)  # ValueError: a body that is not JSON


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _json(response: aiohttp.ClientResponse) -> Any:
    return await response.json(content_type=None)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def probe(session: aiohttp.ClientSession, base: str, timeout: float, api_key: str | None = None) -> ProbeResult:
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
        async with session.get(f"{base}/v1/stats", timeout=limit, headers=auth_headers(api_key)) as response:
            if response.status == 401:
                log.warning("%s/v1/stats answered 401: %s (spec.auth.secretRef)", base,
                            "a wrong API key" if api_key else "the stage wants an API key and the operator has none")
                return ProbeResult(at)
            if response.status != 200:
                return ProbeResult(at, error=f"/v1/stats answered {response.status}")
            stats = await _json(response)
        startup = stats.get("startup")
        loras = await _lora_names(session, base, limit, api_key) if stats.get("state") == "ready" else None
        jobs, cost = stats.get("jobs"), stats.get("cost")
        return ProbeResult(at, state=stats.get("state"), waiting=int(stats.get("waiting", 0)),
                           running=int(stats.get("running", 0)), startup=startup if isinstance(startup, dict) else None,
                           loras=loras, jobs=_job_counts(jobs) if isinstance(jobs, dict) else None,
                           cost=int(cost.get("outstanding") or 0) if isinstance(cost, dict) else None,
                           compile=compile_report(stats.get("compile")), sleep=sleep_report(stats.get("sleep")))
    except _ERRORS as exc:
        return ProbeResult(at, error=_why(exc))


def compile_report(compiled: Any) -> dict[str, Any] | None:
    """What the operator keeps of `/v1/stats.compile` (absent when the stage compiles nothing; the runtime's
    serve/compile_view.py): the mode asked for and the one in effect ("none": eager, because a rank fell back —
    `reason` says why — or because `auto` chose eager — `auto` says why), graphs, recompiles, whether the graph limit
    was reached, the cold compile's seconds and whether the artifact cache answered. None without a usable report
    (mode_effective is null until every rank has reported)."""
    if not isinstance(compiled, dict) or not isinstance(compiled.get("mode_effective"), str):
        return None
    out: dict[str, Any] = {"mode": str(compiled.get("mode") or ""), "mode_effective": compiled["mode_effective"]}
    for key in ("reason", "auto", "cache"):
        out[key] = str(compiled[key]) if compiled.get(key) else None
    for key, kind in (("graphs", int), ("recompiles", int), ("cold_compile_s", float)):
        value = compiled.get(key)
        out[key] = kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    out["graph_limit_reached"] = bool(compiled.get("graph_limit_reached"))
    return out


def sleep_report(sleep: Any) -> dict[str, Any] | None:
    """What the operator keeps of `/v1/stats.sleep` (absent unless the stage runs with sleep mode): whether it sleeps
    now, at which level (None while awake), and how many times it slept and woke. None without a usable report."""
    if not isinstance(sleep, dict) or not isinstance(sleep.get("is_sleeping"), bool):
        return None
    level = sleep.get("level")
    out: dict[str, Any] = {"is_sleeping": sleep["is_sleeping"],
                           "level": level if isinstance(level, int) and not isinstance(level, bool) else None}
    for key in ("sleeps_total", "wakes_total"):
        value = sleep.get(key)
        out[key] = int(value) if isinstance(value, int) and not isinstance(value, bool) else 0
    return out


def _job_counts(jobs: dict[str, Any]) -> dict[str, int]:
    return {k: int(jobs.get(k) or 0) for k in ("here", "queued", "in_progress", "completed", "failed")}


async def _lora_names(session: aiohttp.ClientSession, base: str, limit: aiohttp.ClientTimeout,
                      api_key: str | None) -> tuple[str, ...] | None:
    """The names the stage lists on `/v1/loras`, or None when it does not answer 200 (an older stage)."""
    async with session.get(f"{base}/v1/loras", timeout=limit, headers=auth_headers(api_key)) as response:
        if response.status != 200:
            return None
        body = await _json(response)
    return tuple(str(a["name"]) for a in body.get("data") or () if isinstance(a, dict) and "name" in a)


async def _abort_one(session: aiohttp.ClientSession, base: str, body: dict[str, Any],
                     timeout: float, api_key: str | None) -> dict[str, Any]:
    async with session.post(f"{base}/v1/abort", json=body, timeout=aiohttp.ClientTimeout(total=timeout),
                            headers=auth_headers(api_key)) as response:
        answer = await _json(response)
        if response.status != 200:
            raise aiohttp.ClientResponseError(response.request_info, (), status=response.status, message=str(answer))
        return answer


async def abort(session: aiohttp.ClientSession, targets: Sequence[tuple[str, str | None]],
                request_ids: list[str] | None, timeout: float, api_key: str | None = None) -> dict[str, list[str]]:
    """POST the abort to every (pod, url); {aborted, notFound, unreachable} over all of them. An id is not
    found when no pod had it."""
    body: dict[str, Any] = {"all": True} if request_ids is None else {"request_ids": list(request_ids)}
    reachable = [(pod, url) for pod, url in targets if url]
    unreachable = [f"{pod}: no address" for pod, url in targets if not url]
    answers = await asyncio.gather(*(_abort_one(session, url, body, timeout, api_key) for _, url in reachable),
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


async def list_loras(session: aiohttp.ClientSession, base: str, timeout: float,
                     api_key: str | None) -> list[dict[str, Any]] | str:
    """The adapters the stage lists on `/v1/loras` (name, path, pinned, …), or why it could not be read."""
    try:
        async with session.get(f"{base}/v1/loras", timeout=aiohttp.ClientTimeout(total=timeout),
                               headers=auth_headers(api_key)) as response:
            body = await _json(response)
            if response.status != 200:
                return f"/v1/loras answered {response.status}"
    except _ERRORS as exc:
        return _why(exc)
    return [a for a in body.get("data") or () if isinstance(a, dict) and "name" in a]


async def lora_call(session: aiohttp.ClientSession, base: str, op: str, name: str, body: dict[str, Any] | None,
                    timeout: float, api_key: str | None) -> tuple[int, str]:
    """POST /v1/loras (op "load", body) or DELETE /v1/loras/NAME ("unload"): (HTTP status, the error message);
    status 0 when the stage could not be reached."""
    limit, headers = aiohttp.ClientTimeout(total=timeout), auth_headers(api_key)
    try:
        if op == "load":
            call = session.post(f"{base}/v1/loras", json=body, timeout=limit, headers=headers)
        else:
            call = session.delete(f"{base}/v1/loras/{name}", timeout=limit, headers=headers)
        async with call as response:
            answer = await _json(response)
            return response.status, str((answer.get("error") or {}).get("message") or "")
    except _ERRORS as exc:
        return 0, _why(exc)
