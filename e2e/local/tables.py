"""Server-side printing: what kube-apiserver answers to `Accept: application/json;as=Table;g=meta.k8s.io;v=v1`
(what `kubectl get` asks for). A custom resource's columns are its CRD's `additionalPrinterColumns`
(JSONPath evaluated, `date` columns as an age); pods and events get kubectl's built-in columns; any other
resource Name and Age. Each row carries the object's metadata (`includeObject=Metadata`, the default), the
whole object (`Object`) or nothing (`None`).
"""
from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Sequence
from typing import Any

Obj = dict[str, Any]
NAME_COLUMN = {'name': 'Name', 'type': 'string', 'format': 'name', 'priority': 0,
               'description': 'Name must be unique within a namespace. More info: '
                              'https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names'}
AGE = {'name': 'Age', 'type': 'string', 'format': '', 'priority': 0,
       'description': 'CreationTimestamp is a timestamp representing the server time when this object was created.'}


def wants_table(accept: str) -> bool:
    return any('as=Table' in part and 'g=meta.k8s.io' in part for part in accept.split(','))


def age(timestamp: str | None, now: datetime.datetime | None = None) -> str:
    """apimachinery's HumanDuration of the time since `timestamp` ('<unknown>' without one)."""
    if not timestamp:
        return '<unknown>'
    now = now or datetime.datetime.now(datetime.UTC)
    then = datetime.datetime.fromisoformat(timestamp.replace('Z', '+00:00'))
    s = max(0, int((now - then).total_seconds()))
    m, h, d = s // 60, s // 3600, s // 86400
    if s < 120:
        return f'{s}s'
    if m < 10:
        return f'{m}m{s % 60}s' if s % 60 else f'{m}m'
    if m < 180:
        return f'{m}m'
    if h < 8:
        return f'{h}h{m % 60}m' if m % 60 else f'{h}h'
    if h < 48:
        return f'{h}h'
    if h < 192:
        return f'{d}d{h % 24}h' if h % 24 else f'{d}d'
    return f'{d}d' if d < 365 * 2 else f'{d // 365}y'


# -- JSONPath, the subset printer columns use: .a.b, .a[0], .a[*].b, .a[?(@.k=="v")].b --------------------------
_STEP = re.compile(r'\.([A-Za-z0-9_\-/]+)|\[(\d+|\*)\]|\[\?\(@\.([A-Za-z0-9_.]+)\s*==\s*["\']([^"\']*)["\']\)\]')


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Every value the path selects (kubectl prints them comma-separated)."""
    path = path.strip()
    if path.startswith('{') and path.endswith('}'):
        path = path[1:-1]
    values, position = [obj], 0
    while position < len(path):
        match = _STEP.match(path, position)
        if match is None:
            raise ValueError(f'unsupported JSONPath {path!r} at {path[position:]!r}')
        position = match.end()
        key, index, filter_key, filter_value = match.groups()
        out: list[Any] = []
        for value in values:
            if key is not None and isinstance(value, dict) and key in value:
                out.append(value[key])
            elif index == '*' and isinstance(value, list):
                out.extend(value)
            elif index is not None and index != '*' and isinstance(value, list) and int(index) < len(value):
                out.append(value[int(index)])
            elif filter_key is not None and isinstance(value, list):
                out.extend(item for item in value if _lookup(item, filter_key) == filter_value)
        values = out
    return values


def _lookup(value: Any, dotted: str) -> Any:
    for part in dotted.split('.'):
        value = value.get(part) if isinstance(value, dict) else None
    return None if value is None else str(value)


# -- columns ------------------------------------------------------------------------------------------------------
Column = tuple[Obj, Callable[[Obj], Any]]


def crd_columns(printer_columns: Sequence[Obj]) -> list[Column]:
    columns: list[Column] = [(NAME_COLUMN, lambda o: o['metadata']['name'])]
    for spec in printer_columns or [{'name': 'Age', 'type': 'date', 'jsonPath': '.metadata.creationTimestamp'}]:
        definition = {'name': spec['name'], 'type': spec.get('type', 'string'), 'format': spec.get('format', ''),
                      'description': spec.get('description', ''), 'priority': spec.get('priority', 0)}
        columns.append((definition, _cell(spec)))
    return columns


def _cell(spec: Obj) -> Callable[[Obj], Any]:
    def cell(obj: Obj) -> Any:
        values = jsonpath(obj, spec['jsonPath'])
        if not values:
            return None
        if spec.get('type') == 'date':
            return age(values[0]) if isinstance(values[0], str) else None
        if len(values) == 1:
            return values[0] if isinstance(values[0], (str, int, float, bool)) else str(values[0])
        return ','.join(map(str, values))
    return cell


def _pod_ready(pod: Obj) -> str:
    statuses = (pod.get('status') or {}).get('containerStatuses') or []
    return f'{sum(1 for s in statuses if s.get("ready"))}/{len(pod["spec"].get("containers") or [])}'


def _pod_status(pod: Obj) -> str:
    """What kubectl's STATUS column shows: Terminating, a waiting/terminated reason, else the phase."""
    status = pod.get('status') or {}
    if pod['metadata'].get('deletionTimestamp'):
        return 'Terminating'
    inits = status.get('initContainerStatuses') or ()
    for done, cs in enumerate(inits):  # as kubectl's printPod: the first init container not done names the state
        state = cs.get('state') or {}
        if 'terminated' in state and not state['terminated'].get('exitCode'):
            continue
        if 'terminated' in state:
            return f'Init:{state["terminated"].get("reason") or "Error"}'
        if (reason := (state.get('waiting') or {}).get('reason')) and reason != 'PodInitializing':
            return f'Init:{reason}'
        return f'Init:{done}/{len(pod["spec"].get("initContainers") or inits)}'
    for cs in status.get('containerStatuses') or ():
        state = cs.get('state') or {}
        if 'waiting' in state and state['waiting'].get('reason'):
            return state['waiting']['reason']
        if 'terminated' in state:
            return state['terminated'].get('reason') or 'Error'
    return status.get('reason') or status.get('phase') or 'Pending'


def _column(name: str, kind: str = 'string', priority: int = 0, description: str = '', fmt: str = '') -> Obj:
    return {'name': name, 'type': kind, 'format': fmt, 'description': description, 'priority': priority}


POD_COLUMNS: list[Column] = [
    (NAME_COLUMN, lambda p: p['metadata']['name']),
    (_column('Ready', description='The aggregate readiness state of this pod for accepting traffic.'), _pod_ready),
    (_column('Status', description='The aggregate status of the containers in this pod.'), _pod_status),
    (_column('Restarts', description='The number of times the containers in this pod have been restarted.'),
     lambda p: str(sum(int(c.get('restartCount') or 0) for c in (p.get('status') or {}).get('containerStatuses') or ()))),
    (AGE, lambda p: age(p['metadata'].get('creationTimestamp'))),
    (_column('IP', priority=1, description='IP address allocated to the pod.'),
     lambda p: (p.get('status') or {}).get('podIP') or '<none>'),
    (_column('Node', priority=1, description='Name of the Node this pod is scheduled to.'),
     lambda p: p['spec'].get('nodeName') or '<none>'),
]
EVENT_COLUMNS: list[Column] = [
    (_column('Last Seen', description='Time when this Event was last seen.'),
     lambda e: age(e.get('lastTimestamp') or e.get('eventTime') or e['metadata'].get('creationTimestamp'))),
    (_column('Type', description='Type of this event (Normal, Warning).'), lambda e: e.get('type') or ''),
    (_column('Reason', description='Why the action was taken.'), lambda e: e.get('reason') or ''),
    (_column('Object', description='The object that this event is about.'),
     lambda e: f'{(e.get("involvedObject") or {}).get("kind", "").lower()}/{(e.get("involvedObject") or {}).get("name", "")}'),
    (_column('Message', description='A human-readable description of the status of this operation.'),
     lambda e: (e.get('message') or '').strip()),
]
NAMESPACE_COLUMNS: list[Column] = [
    (NAME_COLUMN, lambda n: n['metadata']['name']),
    (_column('Status', description='The status of the namespace'), lambda n: (n.get('status') or {}).get('phase', '')),
    (AGE, lambda n: age(n['metadata'].get('creationTimestamp')))]


def _node_status(node: Obj) -> str:
    ready = next((c for c in (node.get('status') or {}).get('conditions') or () if c.get('type') == 'Ready'), None)
    text = 'Unknown' if ready is None else 'Ready' if ready.get('status') == 'True' else 'NotReady'
    return text + (',SchedulingDisabled' if (node.get('spec') or {}).get('unschedulable') else '')


NODE_COLUMNS: list[Column] = [
    (NAME_COLUMN, lambda n: n['metadata']['name']),
    (_column('Status', description='The status of the node'), _node_status),
    (AGE, lambda n: age(n['metadata'].get('creationTimestamp')))]
DEFAULT_COLUMNS: list[Column] = [(NAME_COLUMN, lambda o: o['metadata']['name']),
                                 (AGE, lambda o: age(o['metadata'].get('creationTimestamp')))]
BUILTIN_COLUMNS = {'pods': POD_COLUMNS, 'events': EVENT_COLUMNS, 'namespaces': NAMESPACE_COLUMNS, 'nodes': NODE_COLUMNS}


def table(columns: list[Column], objects: Sequence[Obj], include: str = 'Metadata', resource_version: str = '',
          headers: bool = True) -> Obj:
    """A meta.k8s.io/v1 Table of `objects`."""
    rows = []
    for obj in objects:
        row: Obj = {'cells': [cell(obj) for _, cell in columns]}
        if include == 'Object':
            row['object'] = obj
        elif include != 'None':
            row['object'] = {'kind': 'PartialObjectMetadata', 'apiVersion': 'meta.k8s.io/v1',
                             'metadata': obj.get('metadata') or {}}
        rows.append(row)
    out: Obj = {'kind': 'Table', 'apiVersion': 'meta.k8s.io/v1', 'metadata': {'resourceVersion': resource_version},
                'columnDefinitions': [definition for definition, _ in columns] if headers else [], 'rows': rows}
    return out
