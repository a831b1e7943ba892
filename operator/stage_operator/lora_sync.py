"""spec.loras reaches every replica live: a changed list is loaded and unloaded on the running replicas through
their `/v1/loras` control route, without restarting a pod (the pod template hash leaves the list out).

The operator owns the adapters it put there: the spec's names, and the names of the list it last applied
(`status.loraSync.applied`), so an adapter a user loaded at run time on one replica (`POST /v1/loras`, replica-
local) is never touched. New replicas start with the last applied list (their ConfigMap), then get the rest
the same way; a spec entry that a replica refuses (a missing or unfitting file) is reported and never reaches
a starting replica's config, so a bad entry cannot keep replicas from starting.

`plan_calls` (pure) decides one replica's calls from what it lists now; `sync` (async) lists, calls and sums up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from stage_operator import stage_http


@dataclass(frozen=True)
class LoraSync:
    """What one sync did: the list now applied on every ready replica, and what failed (pod: why)."""

    applied: tuple[dict[str, Any], ...]
    errors: tuple[str, ...] = ()
    pending: bool = False                  # a call must be retried (an adapter in use, a replica unreachable)
    calls: tuple[str, ...] = field(default=())   # "pod: load ink" … (for the Event)

    def wire(self) -> dict[str, Any]:
        return {"applied": [dict(a) for a in self.applied], "errors": list(self.errors)}


def wanted(spec_loras: Sequence[Any] | None) -> tuple[dict[str, Any], ...]:
    return tuple({"name": lora.name, "path": lora.path, "pinned": lora.pinned} for lora in spec_loras or ())


def applied(status: Mapping[str, Any], spec_loras: Sequence[Any] | None) -> tuple[dict[str, Any], ...]:
    """The list last applied everywhere; a stage without that record (new, or from an older operator) starts
    from its spec's list (its first replicas load it at startup)."""
    record = status.get("loraSync")
    if not isinstance(record, Mapping):
        return wanted(spec_loras)
    return tuple({"name": a["name"], "path": a["path"], "pinned": bool(a.get("pinned", True))}
                 for a in record.get("applied") or () if isinstance(a, Mapping))


def plan_calls(listed: Sequence[Mapping[str, Any]], want: Sequence[Mapping[str, Any]],
               applied: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """One replica's calls, unloads first: ("unload", name, None) | ("load", name, body)."""
    have = {str(a.get("name")): a for a in listed}
    want_names = {w["name"] for w in want}
    out: list[tuple[str, str, dict[str, Any] | None]] = []
    for name in sorted({a["name"] for a in applied} - want_names):
        if name in have:
            out.append(("unload", name, None))
    for w in want:
        current = have.get(w["name"])
        if current is not None and current.get("path") == w["path"]:
            continue
        if current is not None:
            out.append(("unload", w["name"], None))       # another file under the same name
        out.append(("load", w["name"], dict(w)))
    return out


def needs_sync(want: Sequence[Mapping[str, Any]], applied: Sequence[Mapping[str, Any]],
               listed_names: Mapping[str, Sequence[str] | None]) -> bool:
    """Whether any replica must be looked at: the spec moved from what was applied, or a replica's last probe
    lacks a wanted name or holds a dropped one."""
    if [dict(w) for w in want] != [dict(a) for a in applied]:
        return True
    names = {w["name"] for w in want}
    return any(names - set(listed) for listed in listed_names.values() if listed is not None)


async def sync(session: aiohttp.ClientSession, targets: Sequence[tuple[str, str]], want: Sequence[dict[str, Any]],
               applied: Sequence[dict[str, Any]], timeout: float, api_key: str | None) -> LoraSync:
    """List each ready replica's adapters, make the calls, and say what is applied now (the spec's list when every
    replica took it; else the one applied before, so new replicas still start with a list known to load)."""
    results = await asyncio.gather(*(_one(session, pod, url, want, applied, timeout, api_key) for pod, url in targets))
    errors = tuple(e for _, errs, _ in results for e in errs)
    pending = any(p for _, _, p in results)
    calls = tuple(c for done, _, _ in results for c in done)
    converged = not errors and not pending
    return LoraSync(tuple(want) if converged else tuple(applied), errors, pending, calls)


async def _one(session: aiohttp.ClientSession, pod: str, url: str, want: Sequence[dict[str, Any]],
               applied: Sequence[dict[str, Any]], timeout: float,
               api_key: str | None) -> tuple[list[str], list[str], bool]:
    listed = await stage_http.list_loras(session, url, timeout, api_key)
    if isinstance(listed, str):
        return [], [], True                                  # unreachable now: try again on the next round
    done, errors, pending = [], [], False
    for op, name, body in plan_calls(listed, want, applied):
        status, message = await stage_http.lora_call(session, url, op, name, body, timeout, api_key)
        if status == 200 or (op == "unload" and status == 404):
            done.append(f"{pod}: {op}ed {name}")
        elif status in (503, 0) or (op == "unload" and status == 409):   # starting, unreachable, in use: later
            pending = True
            if op == "unload":
                break                                        # never load another file under a name still held
        else:
            errors.append(f"{pod}: {op} {name}: {message}")
    return done, errors, pending
