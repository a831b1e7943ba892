"""The API's `pods/log` (`GET /api/v1/namespaces/NS/pods/NAME/log`): what `kubectl logs` reads, from the local
kubelet's log files (container_logs.py).

The query is PodLogOptions: `container`, `previous`, `follow`, `tailLines`, `limitBytes`, `timestamps`,
`sinceSeconds`, `sinceTime`. The checks and their words are a real cluster's:
- kube-apiserver: no such pod → 404; no `container` and more than one in the pod → 400 `a container name must be
  specified for pod P, choose one of: [a b]`; a name not in the pod (init containers count) → 400 `container C is
  not valid for pod P`; bad options → 422 Invalid (`PodLogOptions "P" is invalid: ...`).
- the kubelet (`validateContainerLogStatus`): which run's log from the container's status — `previous`: its
  lastState's (else 400 `previous terminated container "C" in pod "P" not found`); running or terminated: that
  run's; waiting after a run: the last run's; waiting before any: 400 `container "C" in pod "P" is waiting to
  start: REASON`.
`follow` streams new lines until the run's log is complete (the container exited and its pipes closed), the
client goes away, or the API stops.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp.web

from e2e.local import container_logs
from e2e.local.container_logs import ContainerLogs, Line

PATH = re.compile(r'^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log$')
FOLLOW_POLL = 0.1  # seconds between looks at a followed file
Obj = dict[str, Any]


class LogError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _flag(query: Any, key: str) -> bool:
    return query.get(key, 'false').lower() in ('true', '1')


def _options(query: Any, pod: str) -> Obj:
    """PodLogOptions from the query, checked as kube-apiserver checks them."""
    out: Obj = {'container': query.get('container', ''), 'previous': _flag(query, 'previous'),
                'follow': _flag(query, 'follow'), 'timestamps': _flag(query, 'timestamps')}
    problems = []
    for key, least, rule in (('tailLines', 0, 'must be greater than or equal to 0'),
                             ('limitBytes', 1, 'must be greater than 0'),
                             ('sinceSeconds', 1, 'must be greater than 0')):
        if key not in query:
            continue
        try:
            out[key] = int(query[key])
        except ValueError:
            raise LogError(400, 'BadRequest', f'{key}: invalid value {query[key]!r}: not an integer') from None
        if out[key] < least:
            problems.append(f'{key}: Invalid value: {out[key]}: {rule}')
    if 'sinceTime' in query:
        try:
            out['sinceTime'] = container_logs.parse_time(query['sinceTime'])
        except ValueError:
            raise LogError(400, 'BadRequest', f'sinceTime: invalid value {query["sinceTime"]!r}: '
                                              'not an RFC 3339 time') from None
        if 'sinceSeconds' in out:
            problems.append('Forbidden: at most one of `sinceTime` or `sinceSeconds` may be specified')
    if problems:
        raise LogError(422, 'Invalid', f'PodLogOptions "{pod}" is invalid: [{", ".join(problems)}]'
                       if len(problems) > 1 else f'PodLogOptions "{pod}" is invalid: {problems[0]}')
    return out


def _container(pod: Obj, wanted: str) -> str:
    spec, name = pod.get('spec') or {}, pod['metadata']['name']
    names = [c['name'] for key in ('initContainers', 'containers', 'ephemeralContainers') for c in spec.get(key) or ()]
    if not wanted:
        if len(spec.get('containers') or ()) == 1:
            return spec['containers'][0]['name']
        raise LogError(400, 'BadRequest', f'a container name must be specified for pod {name}, choose one of: '
                                          f'[{" ".join(names)}]')
    if wanted not in names:
        raise LogError(400, 'BadRequest', f'container {wanted} is not valid for pod {name}')
    return wanted


def log_file(pod: Obj, container: str, previous: bool, logs: ContainerLogs) -> Path:
    """The log of the run the kubelet would read (validateContainerLogStatus), or the 400 it answers."""
    meta, status = pod['metadata'], pod.get('status') or {}
    statuses = [*(status.get('containerStatuses') or ()), *(status.get('initContainerStatuses') or ())]
    found = next((s for s in statuses if s.get('name') == container), None)

    def bad(message: str) -> LogError:
        return LogError(400, 'BadRequest', message)

    if found is None:
        raise bad(f'container "{container}" in pod "{meta["name"]}" is not available')
    state, last = found.get('state') or {}, ((found.get('lastState') or {}).get('terminated') or {})
    if previous:
        if not last.get('containerID'):
            raise bad(f'previous terminated container "{container}" in pod "{meta["name"]}" not found')
        cid = last['containerID']
    elif 'running' in state:
        cid = found.get('containerID', '')
    elif 'terminated' in state:
        cid = state['terminated'].get('containerID') or last.get('containerID') or ''
        if not cid:
            raise bad(f'container "{container}" in pod "{meta["name"]}" is terminated')
    elif last.get('containerID'):
        cid = last['containerID']
    else:
        reason = (state.get('waiting') or {}).get('reason') or ''
        raise bad(f'container "{container}" in pod "{meta["name"]}" is waiting to start: {reason}' if reason else
                  f'container "{container}" in pod "{meta["name"]}" is waiting to start - no logs yet')
    run = container_logs.run_of(cid, meta.get('uid', ''), container)
    if run is None:  # a status some other kubelet (a test playing it) wrote: no file of ours
        raise bad(f'container "{container}" in pod "{meta["name"]}": no local log for containerID {cid!r}')
    return logs.path(meta['namespace'], meta['name'], meta.get('uid', ''), container, run)


def _first(lines: list[Line], options: Obj) -> list[Line]:
    """What the options keep of the lines already written (tailLines, sinceSeconds, sinceTime)."""
    if 'sinceSeconds' in options:
        lines = container_logs.since(lines, time.time() - options['sinceSeconds'])
    if 'sinceTime' in options:
        lines = container_logs.since(lines, options['sinceTime'])
    if 'tailLines' in options:
        lines = container_logs.tail(lines, options['tailLines'])
    return lines


async def serve(raw: aiohttp.web.BaseRequest, match: re.Match[str], get_pod: Callable[[str, str], Obj | None],
                logs: ContainerLogs | None, closing: Callable[[], bool]) -> aiohttp.web.StreamResponse:
    if raw.method != 'GET':
        return _status(405, 'MethodNotAllowed', f'the server does not allow this method on pods/log: {raw.method}')
    if logs is None:
        return _status(404, 'NotFound', 'pods/log: no kubelet serves logs to this API (the pod runner does)')
    pod = get_pod(match['ns'], match['name'])
    if pod is None:
        return _status(404, 'NotFound', f'pods "{match["name"]}" not found')
    try:
        options = _options(raw.query, match['name'])
        container = _container(pod, options['container'])
        path = log_file(pod, container, options['previous'], logs)
    except LogError as exc:
        return _status(exc.code, exc.reason, exc.message)
    response = aiohttp.web.StreamResponse(status=200, headers={'Content-Type': 'text/plain'})
    await response.prepare(raw)
    budget = options.get('limitBytes')
    offset, first = 0, True
    try:
        while True:
            done = not (options['follow'] and logs.is_open(path))  # looked at before the read: nothing is missed
            data = _read_from(path, offset)
            lines, used = container_logs.parse(data)
            offset += used
            chunk = container_logs.render(_first(lines, options) if first else lines, options['timestamps'])
            first = False
            if budget is not None:
                chunk, budget = chunk[:budget], budget - len(chunk[:budget])
            if chunk:
                await response.write(chunk)
            if done or budget == 0 or closing():
                break
            await asyncio.sleep(FOLLOW_POLL)
        await response.write_eof()
    except ConnectionResetError:  # the client went away (kubectl logs -f ended with Ctrl-C)
        pass
    return response


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with open(path, 'rb') as file:
            file.seek(offset)
            return file.read()
    except FileNotFoundError:
        return b''


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure',
                                      'message': message, 'reason': reason, 'code': code}, status=code)
