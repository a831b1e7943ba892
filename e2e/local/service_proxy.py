"""The API server's service proxy, `/api/v1/namespaces/NS/services/NAME[:PORT]/proxy/PATH` (what `kubectl
proxy` and a curl with the kubeconfig's address reach): the request goes to one ready pod behind the Service
(round robin), its answer streams back (server-sent events included). The pods are picked as in services.py
(selector, Ready, not terminating, the target port by name or number). 503 when no pod is ready.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
import aiohttp.web

from e2e.local.services import _ready, _target_port

PATH = re.compile(r'^/api/v1/namespaces/(?P<ns>[^/]+)/services/(?P<name>[^/:]+)(?::(?P<port>[^/]+))?/proxy(?P<rest>/.*)?$')
HOP_BY_HOP = {'connection', 'keep-alive', 'transfer-encoding', 'upgrade', 'host', 'content-length', 'authorization'}
Obj = dict[str, Any]
_turn = itertools.count()


def endpoints(service: Obj, pods: Iterable[Obj], port: str | None) -> list[str]:
    ports = service['spec'].get('ports') or []
    chosen = next((p for p in ports if port in (None, p.get('name'), str(p.get('port')))), None)
    if chosen is None:
        return []
    target = chosen.get('targetPort', chosen['port'])
    return sorted({f'http://{pod["status"]["podIP"]}:{number}' for pod in pods
                   if _ready(pod) and (number := _target_port(pod, target)) is not None})


async def proxy(raw: aiohttp.web.BaseRequest, match: re.Match[str],
                lookup: Callable[[str, str], tuple[Obj | None, list[Obj]]]) -> aiohttp.web.StreamResponse:
    """Forward to a pod of the Service; `lookup(ns, name)` gives the Service and the pods its selector picks."""
    service, pods = lookup(match['ns'], match['name'])
    if service is None:
        return _status(404, 'NotFound', f'services "{match["name"]}" not found')
    urls = endpoints(service, pods, match['port'])
    if not urls:
        return _status(503, 'ServiceUnavailable', f'no endpoints available for service "{match["name"]}"')
    url = urls[next(_turn) % len(urls)] + (match['rest'] or '/')
    headers = {k: v for k, v in raw.headers.items() if k.lower() not in HOP_BY_HOP}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as session:
        async with session.request(raw.method, url, params=raw.query, headers=headers, data=await raw.read()) as answer:
            response = aiohttp.web.StreamResponse(status=answer.status, headers={
                k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP})
            await response.prepare(raw)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure',
                                      'message': message, 'reason': reason, 'code': code}, status=code)
