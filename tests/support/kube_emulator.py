"""A Kubernetes API for tests: kmock 0.8 plus the API semantics an operator relies on.

`KubeEmulator` serves a real HTTP Kubernetes API on a localhost port; kopf and the official
`kubernetes` client reach it through a kubeconfig (`write_kubeconfig`, fixture `kubeconfig`).
It keeps kmock's server, discovery (/api, /apis/...), Status-shaped errors and reaction DSL (a
test can still inject faults: `emulator['patch', kmock.resource('v1/pods')] << 500`) and replaces
kmock's object store, because plain kmock 0.8 gets these wrong (each is fixed here):

- no server-assigned uid, resourceVersion, creationTimestamp, generation; create answers 200, not 201;
- labelSelector and fieldSelector are ignored on list and watch; watch ignores resourceVersion;
- PATCH .../status patches the whole object, and main-resource writes change .status;
- PUT answers 404; no 409 on a stale resourceVersion or on creating an existing name;
- merge patch only: no json-patch (a failing `test` op gives 500, kopf expects 422), null does not delete;
- GET /api/v1/namespaces answers 500 (kmock's path parser); there is no `default` namespace;
- generateName answers 500; objects posted without metadata.namespace vanish from watches;
- no ownerReference garbage collection; finalizer release emits MODIFIED and DELETED.

Added: scale subresource, deletecollection, CRDs posted to the API become served resources, and
a mutating-call counter (`counts`, `mutations`, `reset_counts()`).
Not emulated: kubelet, scheduler and controllers (tests play them), schema/CEL validation,
admission, server-side apply, strategic-merge list semantics (treated as a JSON merge patch),
/openapi (kubectl needs --validate=false), graceful pod deletion (pods go at once), dryRun.

Pinned to kmock==0.8 internals: KubernetesScaffold (discovery, `_render_error`), RawHandler
`_requests`/`_errors`/`_handle`, rendering.Request/Response/StreamingError, parsing.ParsedPath/guess_k8s.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import copy
import datetime
import json
import random
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import pytest
from kmock._internal import enums, parsing, rendering

VERBS = ('create', 'delete', 'deletecollection', 'get', 'list', 'patch', 'update', 'watch')
BUILTINS = [  # resource, kind, namespaced, subresources, short names
    ('v1/namespaces', 'Namespace', False, ('status',), ('ns',)),
    ('v1/nodes', 'Node', False, ('status',), ('no',)),
    ('v1/pods', 'Pod', True, ('status',), ('po',)),
    ('v1/services', 'Service', True, ('status',), ('svc',)),
    ('v1/configmaps', 'ConfigMap', True, (), ('cm',)),
    ('v1/secrets', 'Secret', True, (), ()),
    ('v1/events', 'Event', True, (), ('ev',)),
    ('coordination.k8s.io/v1/leases', 'Lease', True, (), ()),
    ('apiextensions.k8s.io/v1/customresourcedefinitions', 'CustomResourceDefinition', False, ('status',), ('crd',)),
    ('kopf.dev/v1/kopfpeerings', 'KopfPeering', True, (), ()),
    ('kopf.dev/v1/clusterkopfpeerings', 'ClusterKopfPeering', False, (), ()),
    ('diffstage.io/v1alpha1/diffusionstages', 'DiffusionStage', True, ('status', 'scale'), ('dstage',)),
]
NAMESPACES, PODS = kmock.resource('v1/namespaces'), kmock.resource('v1/pods')
CRDS = kmock.resource('apiextensions.k8s.io/v1/customresourcedefinitions')
INITIAL_STATUS = {PODS: {'phase': 'Pending'}, NAMESPACES: {'phase': 'Active'}}
SERVER_OWNED = ('name', 'namespace', 'uid', 'creationTimestamp', 'deletionTimestamp',
                'deletionGracePeriodSeconds', 'generation', 'resourceVersion')
Key = tuple[kmock.resource, str | None, str]


def _error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details or {'reason': reason})


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ')


def _api_version(res: kmock.resource) -> str:
    return f'{res.group}/{res.version}' if res.group else res.version


def _parse_path(path: str) -> parsing.ParsedPath | None:
    """Split a resource URL; None for discovery and other URLs (kmock parses those fine)."""
    parts = [part for part in path.split('/') if part]
    if len(parts) >= 3 and parts[0] == 'api':
        group, version, rest = '', parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == 'apis':
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None  # /api/v1/namespaces/x/status is the namespace's own subresource
    if len(rest) >= 3 and rest[0] == 'namespaces' and rest[2] not in ('status', 'finalize'):
        namespace, rest = rest[1], rest[2:]
    name = rest[1] if len(rest) > 1 else None
    return parsing.ParsedPath(group, version, rest[0], namespace, name, '/'.join(rest[2:]) or None)


def _labels_match(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in re.split(r',(?![^(]*\))', selector))):
        if m := re.fullmatch(r'(\S+)\s+(in|notin)\s*\((.*)\)', term):
            ok = (labels.get(m[1]) in {v.strip() for v in m[3].split(',')}) == (m[2] == 'in')
        elif m := re.fullmatch(r'([^!=\s]+)\s*(==|=|!=)\s*(.*)', term):
            ok = (labels.get(m[1]) == m[3].strip()) != (m[2] == '!=')
        else:
            ok = (term[1:].strip() not in labels) if term.startswith('!') else (term in labels)
        if not ok:
            return False
    return True


def _fields_match(selector: str, obj: dict[str, Any]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(','))):
        if not (m := re.fullmatch(r'([^!=\s]+)\s*(==|=|!=)\s*(.*)', term)):
            raise _error(400, 'BadRequest', f'invalid field selector: {term!r}')
        value: Any = obj
        for part in m[1].split('.'):
            value = value.get(part) if isinstance(value, dict) else None
        text = '' if value is None else value if isinstance(value, str) else json.dumps(value)
        if (text == m[3].strip()) == (m[2] == '!='):
            return False
    return True


def _merge_patch(target: Any, patch: Any) -> Any:  # RFC 7386
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    return [p.replace('~1', '/').replace('~0', '~') for p in path.split('/')[1:]]


def _resolve(doc: Any, path: list[str]) -> Any:
    for part in path:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _add(doc: Any, path: list[str], value: Any) -> Any:
    if not path:
        return value
    parent, last = _resolve(doc, path[:-1]), path[-1]
    if isinstance(parent, list):
        index = len(parent) if last == '-' else int(last)
        if not 0 <= index <= len(parent):
            raise IndexError(f'index {index} out of range')
        parent.insert(index, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise TypeError(f'cannot add into {type(parent).__name__}')
    return doc


def _remove(doc: Any, path: list[str]) -> Any:
    parent = _resolve(doc, path[:-1])
    del parent[int(path[-1]) if isinstance(parent, list) else path[-1]]
    return doc


def _json_patch(doc: Any, ops: Any) -> Any:  # RFC 6902; any failure (a `test` op included) is 422
    if not isinstance(ops, list):
        raise _error(400, 'BadRequest', 'a json patch must be a list of operations')
    doc = copy.deepcopy(doc)
    for op in ops:
        try:
            kind, path = op['op'], _pointer(op['path'])
            if kind == 'test' and _resolve(doc, path) != op['value']:
                raise ValueError(f'test failed at {op["path"]}')
            elif kind in ('add', 'replace'):
                if kind == 'replace':
                    doc = _remove(doc, path) if path else doc
                doc = _add(doc, path, copy.deepcopy(op['value']))
            elif kind == 'remove':
                doc = _remove(doc, path)
            elif kind in ('move', 'copy'):
                value = copy.deepcopy(_resolve(doc, _pointer(op['from'])))
                doc = _add(_remove(doc, _pointer(op['from'])) if kind == 'move' else doc, path, value)
            elif kind != 'test':
                raise ValueError(f'unknown op {kind!r}')
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise _error(422, 'Invalid', f'json patch failed: {e}', causes=[{'message': str(e)}])
    return doc


def _without_status(obj: dict[str, Any], status: Any = None) -> dict[str, Any]:
    result = {key: value for key, value in obj.items() if key != 'status'}
    return result if status is None else {**result, 'status': copy.deepcopy(status)}


def _spec(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ('apiVersion', 'kind', 'metadata', 'status')}


def _scale(obj: dict[str, Any]) -> dict[str, Any]:
    meta, spec, status = obj['metadata'], obj.get('spec') or {}, obj.get('status') or {}
    return {'apiVersion': 'autoscaling/v1', 'kind': 'Scale',
            'metadata': {k: meta[k] for k in ('name', 'namespace', 'uid', 'resourceVersion', 'creationTimestamp') if k in meta},
            'spec': {'replicas': spec.get('replicas', 0)},
            'status': {'replicas': status.get('replicas', 0), 'selector': status.get('selector', '')}}


def _is_object_request(request: rendering.Request) -> bool:
    return request.resource is not None and request.resource.plural is not None


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesScaffold):
    """The emulated API. Start it with `running()` or the `kube_emulator` fixture."""

    base_url: str = attrs.field(default='', init=False)
    counts: collections.Counter[tuple[str, str, str | None]] = attrs.field(factory=collections.Counter, init=False)
    mutations: list[tuple[str, str, str | None, str | None, str | None]] = attrs.field(factory=list, init=False)
    _store: dict[Key, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _log: list[tuple[int, kmock.resource, Any, Any]] = attrs.field(factory=list, init=False)  # rv, res, before, after
    _rv: int = attrs.field(default=0, init=False)
    _lock: threading.RLock = attrs.field(factory=threading.RLock, init=False)
    _loop: asyncio.AbstractEventLoop | None = attrs.field(default=None, init=False)
    _wakeup: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _closing: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # the scaffold: discovery, 404 for unknown URLs
        self.fallback[_is_object_request] << self._serve
        for resource, kind, namespaced, subresources, shortnames in BUILTINS:
            self.declare(resource, kind, namespaced=namespaced, subresources=subresources, shortnames=shortnames)
        self.seed('v1/namespaces', {'metadata': {'name': 'default'}})

    # -- declaring and inspecting, from tests (any thread) ------------------------------------------
    def declare(self, resource: str, kind: str, *, namespaced: bool = True,
                subresources: tuple[str, ...] = (), shortnames: tuple[str, ...] = ()) -> None:
        """Serve a resource, e.g. declare('example.com/v1/widgets', 'Widget', subresources=('status',))."""
        self.resources[resource] = kmock.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=namespaced, verbs=VERBS,
            subresources=subresources, shortnames=shortnames)

    def declare_crd(self, crd: dict[str, Any]) -> None:
        spec, names = crd['spec'], crd['spec']['names']
        for version in spec['versions']:
            self.declare(f"{spec['group']}/{version['name']}/{names['plural']}", names['kind'],
                         namespaced=spec.get('scope', 'Namespaced') == 'Namespaced',
                         subresources=tuple(version.get('subresources') or ()),
                         shortnames=tuple(names.get('shortNames') or ()))

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Copies of the stored objects of a resource ('pods', 'v1/pods', 'dstage', ...)."""
        res = self._resource(resource)
        with self._lock:
            return [copy.deepcopy(o) for (r, ns, _), o in self._store.items()
                    if r == res and namespace in (None, ns)]

    def get(self, resource: str, name: str, namespace: str = 'default') -> dict[str, Any] | None:  # type: ignore[override]
        """A copy of one object, or None (this shadows kmock's HTTP-client shortcut `get`)."""
        res = self._resource(resource)
        with self._lock:
            obj = self._store.get((res, namespace if self.resources[res].namespaced else None, name))
            return copy.deepcopy(obj)

    def seed(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as-is (status included: nodes, running pods), with server-assigned fields."""
        res = self._resource(resource)
        obj = copy.deepcopy(obj)
        meta = obj.setdefault('metadata', {})
        if self.resources[res].namespaced:
            meta.setdefault('namespace', 'default')
        else:
            meta.pop('namespace', None)
        with self._lock:
            if (res, meta.get('namespace'), meta['name']) in self._store:
                raise ValueError(f'{res.plural} {meta["name"]!r} already exists')
            return self._insert(res, obj)

    @property
    def mutation_count(self) -> int:
        return len(self.mutations)

    def reset_counts(self) -> None:
        self.counts.clear()
        self.mutations.clear()

    def write_kubeconfig(self, path: str | Path) -> Path:
        config = {'apiVersion': 'v1', 'kind': 'Config', 'current-context': 'emulator',
                  'clusters': [{'name': 'emulator', 'cluster': {'server': self.base_url}}],
                  'users': [{'name': 'emulator', 'user': {'token': 'emulator'}}],
                  'contexts': [{'name': 'emulator', 'context': {'cluster': 'emulator', 'user': 'emulator',
                                                                'namespace': 'default'}}]}
        Path(path).write_text(json.dumps(config, indent=2))
        return Path(path)

    def api_client(self) -> Any:
        """An official-client ApiClient bound to this emulator (no kubeconfig or globals involved)."""
        import kubernetes
        configuration = kubernetes.client.Configuration()
        configuration.host = self.base_url
        return kubernetes.client.ApiClient(configuration)

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        result = await super()._serve_version(request)
        result['groupVersion'] = _api_version(request.resource)  # kmock says '/v1' for the core group
        return result

    def _resource(self, resource: str | kmock.resource) -> kmock.resource:
        res = resource if isinstance(resource, kmock.resource) else kmock.resource(resource)
        if res.version is None:  # a bare plural or short name
            res = next((r for r in self.resources
                        if res.plural in (r.plural, *self.resources[r].shortnames)), res)
        if res not in self.resources:
            raise KeyError(f'resource {resource!r} is not declared')
        return res

    # -- HTTP: parsing, counting, dispatch ------------------------------------------------------
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw.read()
        raw_response: aiohttp.web.StreamResponse | None = None
        try:
            k8s = _parse_path(raw.path)
            request = (await rendering.Request._parse(raw, id=len(self._requests)) if k8s is None
                       else self._parse(raw, body, k8s))
            self._requests.append(request)
            try:
                return await self._handle(request)
            except rendering.StreamingError as e:  # the response already started streaming
                raw_response = e.args[0]
                raise e.__cause__ or e
        except Exception as e:
            if not isinstance(e, kmock.KubernetesError) and self._errors:
                self._errors[-1].append(e)  # an emulator bug, not an API answer: the fixture fails on it
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(e)
            await self._stream_error(e, raw_response)
            await raw_response.write_eof()
            return raw_response

    def _parse(self, raw: aiohttp.web.BaseRequest, body: bytes, k8s: parsing.ParsedPath) -> rendering.Request:
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        method, query = enums.method(raw.method), dict(raw.query)
        verb = {'POST': 'create', 'PUT': 'update', 'PATCH': 'patch', 'DELETE': 'delete'}.get(raw.method)
        if verb:
            verb = 'deletecollection' if verb == 'delete' and k8s.name is None else verb
            self.counts[(verb, k8s.plural, k8s.subresource)] += 1
            self.mutations.append((verb, k8s.plural, k8s.namespace, k8s.name, k8s.subresource))
        return rendering.Request(
            id=len(self._requests), raw_request=raw, url=raw.url, method=method, params=query,
            headers=dict(raw.headers), cookies=dict(raw.cookies), body=body,
            text=body.decode('utf-8', 'replace'), data=data, action=parsing.guess_k8s(k8s, method, query),
            resource=kmock.resource(k8s.group, k8s.version, k8s.plural),
            namespace=k8s.namespace, name=k8s.name, subresource=k8s.subresource)

    async def _serve(self, request: rendering.Request) -> rendering.Payload:
        res, method, sub = request.resource, request.method.value, request.subresource
        if res not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        info = self.resources[res]
        if sub is not None and sub not in info.subresources:
            raise _error(404, 'NotFound', f'the server could not find the requested resource ({sub})')
        if method == 'GET' and request.params.get('watch') in ('true', '1'):
            return rendering.Response(headers={'Content-Type': 'application/json'}, payload=self._watch(request))
        with self._lock:
            if request.name is None and method in ('GET', 'DELETE'):
                keys = [k for k, o in self._store.items() if k[0] == res and self._selected(request, o)]
                items = [self._delete(k, 'Background') if method == 'DELETE' else copy.deepcopy(self._store[k])
                         for k in keys if k in self._store]
                return {'apiVersion': _api_version(res), 'kind': f'{info.kind}List',
                        'metadata': {'resourceVersion': str(self._rv)}, 'items': items}
            if request.name is None and method == 'POST':
                return rendering.Response(status=201, payload=self._create(request))
            key = (res, request.namespace if info.namespaced else None, request.name)
            if key not in self._store:
                raise _error(404, 'NotFound', f'{res.plural} "{request.name}" not found', name=request.name, kind=res.plural)
            if method == 'GET':
                obj = copy.deepcopy(self._store[key])
            elif method == 'DELETE':
                obj = self._delete(key, self._check_delete_options(key, request.data or {}, request.params))
            elif method in ('PUT', 'PATCH'):
                obj = self._write(key, request)
            else:
                raise _error(405, 'MethodNotAllowed', f'{method} is not supported')
            return _scale(obj) if sub == 'scale' else obj

    # -- the store: all under self._lock ----------------------------------------------------------
    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, res: kmock.resource, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
        self._log.append((self._rv, res, copy.deepcopy(before), copy.deepcopy(after)))
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is watching
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._notify)

    def _notify(self) -> None:  # in the server's loop
        self._wakeup, wakeup = asyncio.Event(), self._wakeup
        wakeup.set()

    def _selected(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        meta = obj['metadata']
        return bool(request.namespace in (None, meta.get('namespace')) and request.name in (None, meta.get('name'))
                    and _labels_match(request.params.get('labelSelector', ''), meta.get('labels') or {})
                    and _fields_match(request.params.get('fieldSelector', ''), obj))

    def _create(self, request: rendering.Request) -> dict[str, Any]:
        res, info = request.resource, self.resources[request.resource]
        if not isinstance(request.data, dict):
            raise _error(400, 'BadRequest', 'the body must be a JSON object')
        obj = copy.deepcopy(request.data)
        meta = obj['metadata'] = {k: v for k, v in (obj.get('metadata') or {}).items() if k not in SERVER_OWNED[2:]}
        if info.namespaced:
            if request.namespace and meta.get('namespace', request.namespace) != request.namespace:
                raise _error(400, 'BadRequest', 'the namespace of the object does not match the namespace of the URL')
            meta['namespace'] = namespace = request.namespace or meta.get('namespace')
            if (NAMESPACES, None, namespace) not in self._store:
                raise _error(404, 'NotFound', f'namespaces "{namespace}" not found', name=namespace, kind='namespaces')
        else:
            meta.pop('namespace', None)
        if not meta.get('name'):
            if not meta.get('generateName'):
                raise _error(422, 'Invalid', 'metadata.name or metadata.generateName is required')
            meta['name'] = meta['generateName'] + ''.join(random.choices('bcdfghjklmnpqrstvwxz2456789', k=5))
        if (res, meta.get('namespace'), meta['name']) in self._store:
            raise _error(409, 'AlreadyExists', f'{res.plural} "{meta["name"]}" already exists', name=meta['name'], kind=res.plural)
        return self._insert(res, _without_status(obj) if 'status' in info.subresources else obj)

    def _insert(self, res: kmock.resource, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj['metadata']
        obj.update(apiVersion=_api_version(res), kind=self.resources[res].kind)
        if 'status' not in obj and res in INITIAL_STATUS:
            obj['status'] = copy.deepcopy(INITIAL_STATUS[res])
        meta.setdefault('uid', str(uuid.uuid4()))
        meta.setdefault('creationTimestamp', _now())
        meta.update(generation=1, resourceVersion=self._bump())
        self._store[res, meta.get('namespace'), meta['name']] = obj
        self._emit(res, None, obj)
        if res == CRDS:
            self.declare_crd(obj)
        return copy.deepcopy(obj)

    def _write(self, key: Key, request: rendering.Request) -> dict[str, Any]:
        """PUT or PATCH of the object, its status or its scale."""
        old, sub, info = self._store[key], request.subresource, self.resources[key[0]]
        current = _scale(old) if sub == 'scale' else old
        content_type = request.headers.get('Content-Type', '')
        if request.method.value == 'PUT':
            new = request.data
            if isinstance(new, dict) and (new.get('metadata') or {}).get('name', key[2]) != key[2]:
                raise _error(400, 'BadRequest', 'the name of the object does not match the name of the URL')
        elif 'json-patch' in content_type:
            new = _json_patch(current, request.data)
        elif 'merge-patch' in content_type:  # strategic merge patches are treated as merge patches
            new = _merge_patch(current, request.data)
        else:
            raise _error(415, 'UnsupportedMediaType', f'unsupported patch type: {content_type!r}')
        if not isinstance(new, dict):
            raise _error(400, 'BadRequest', 'the body must be a JSON object')
        rv = (new.get('metadata') or {}).get('resourceVersion')
        if rv and rv != old['metadata']['resourceVersion']:
            raise _error(409, 'Conflict', 'the object has been modified; please apply your changes to the latest '
                                          'version and try again', name=key[2], kind=key[0].plural)
        if sub == 'scale':
            new = {**copy.deepcopy(old), 'spec': {**(old.get('spec') or {}), 'replicas': (new.get('spec') or {}).get('replicas')}}
        elif sub == 'status':
            new = _without_status(old, new.get('status'))
        elif 'status' in info.subresources:
            new = _without_status(new, old.get('status'))
        return self._update(key, new)

    def _update(self, key: Key, new: dict[str, Any]) -> dict[str, Any]:
        old, new = self._store[key], copy.deepcopy(new)
        old_meta = old['metadata']
        meta = new['metadata'] = new.get('metadata') if isinstance(new.get('metadata'), dict) else {}
        for field in SERVER_OWNED:
            meta.pop(field, None)
            if field in old_meta:
                meta[field] = old_meta[field]
        new.update(apiVersion=old['apiVersion'], kind=old['kind'])
        if meta.get('deletionTimestamp') and set(meta.get('finalizers') or ()) - set(old_meta.get('finalizers') or ()):
            raise _error(422, 'Invalid', 'no new finalizers can be added if the object is being deleted')
        if new == old:
            return copy.deepcopy(old)  # a no-op write: no new resourceVersion, no event
        if _spec(new) != _spec(old):
            meta['generation'] = old_meta.get('generation', 1) + 1
        self._store[key] = new
        if meta.get('deletionTimestamp') and not meta.get('finalizers'):
            return self._remove(key)
        meta['resourceVersion'] = self._bump()
        self._emit(key[0], old, new)
        return copy.deepcopy(new)

    def _check_delete_options(self, key: Key, options: dict[str, Any], params: dict[str, str]) -> str:
        meta = self._store[key]['metadata']
        for field, expected in (options.get('preconditions') or {}).items():
            if expected is not None and meta.get(field) != expected:
                raise _error(409, 'Conflict', f'precondition failed: {field} {expected!r} != {meta.get(field)!r}')
        return options.get('propagationPolicy') or params.get('propagationPolicy') or 'Background'

    def _delete(self, key: Key, propagation: str = 'Background') -> dict[str, Any]:
        obj = self._store[key]
        meta = obj['metadata']
        if not meta.get('finalizers'):
            return self._remove(key, orphan=propagation == 'Orphan')
        if not meta.get('deletionTimestamp'):  # finalizers hold it: mark it and let them release it
            old = copy.deepcopy(obj)
            meta.update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0, resourceVersion=self._bump())
            self._emit(key[0], old, obj)
        return copy.deepcopy(obj)

    def _remove(self, key: Key, orphan: bool = False) -> dict[str, Any]:
        """Remove for good, then collect the garbage: dependents with no live owner left, a namespace's content."""
        obj = self._store.pop(key)
        obj['metadata']['resourceVersion'] = self._bump()
        self._emit(key[0], obj, None)
        uid = obj['metadata'].get('uid')
        for dkey, dependent in list(self._store.items()):
            refs = dependent['metadata'].get('ownerReferences') or []
            owned = not orphan and any(ref.get('uid') == uid for ref in refs)
            if dkey in self._store and (owned or (key[0] == NAMESPACES and dkey[1] == key[2])):
                live = {o['metadata'].get('uid') for o in self._store.values()}
                if key[0] == NAMESPACES or not any(ref.get('uid') in live for ref in refs):
                    self._delete(dkey)
        return copy.deepcopy(obj)

    async def _watch(self, request: rendering.Request) -> Any:
        yield b''  # send the headers now: a quiet watch is still a started watch
        loop, res = asyncio.get_running_loop(), request.resource
        timeout = float(request.params.get('timeoutSeconds') or 0)
        deadline = loop.time() + timeout if timeout > 0 else None
        since = request.params.get('resourceVersion') or '0'
        with self._lock:
            if since == '0' or not since.isdigit():  # "any": the current objects as ADDED, then changes
                position = len(self._log)
                initial = [copy.deepcopy(o) for k, o in self._store.items() if k[0] == res and self._selected(request, o)]
            else:  # exactly the changes after that resourceVersion
                position, initial = bisect.bisect_right(self._log, int(since), key=lambda e: e[0]), []
        for obj in initial:
            yield {'type': 'ADDED', 'object': obj}
        while not self._closing:
            wakeup = self._wakeup
            with self._lock:
                events, position = self._log[position:], len(self._log)
            for _, event_res, before, after in events:
                was = event_res == res and before is not None and self._selected(request, before)
                now = event_res == res and after is not None and self._selected(request, after)
                if was or now:  # entering or leaving the selection reads as ADDED or DELETED
                    kind = 'MODIFIED' if was and now else 'ADDED' if now else 'DELETED'
                    yield {'type': kind, 'object': after if after is not None else before}
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), remaining)

    def _shutdown(self) -> None:  # in the server's loop
        self._closing = True
        self._notify()


@contextlib.contextmanager
def running(emulator: KubeEmulator | None = None, *, timeout: float = 10) -> Iterator[KubeEmulator]:
    """Serve the emulator on a free localhost port from a thread with its own event loop."""
    emulator = KubeEmulator() if emulator is None else emulator
    loop, ready, failures = asyncio.new_event_loop(), threading.Event(), []
    stop = asyncio.Event()

    async def serve() -> None:
        async with emulator, kmock.Server(emulator) as server:
            emulator.base_url = f'http://{server.host}:{server.port}'
            ready.set()
            await stop.wait()

    def main() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as e:
            failures.append(e)
        finally:
            ready.set()
            loop.close()

    emulator._loop = loop
    thread = threading.Thread(target=main, name='kube-emulator', daemon=True)
    thread.start()
    if not ready.wait(timeout) or failures:
        raise RuntimeError('the Kubernetes emulator did not start') from (failures[0] if failures else None)
    try:
        yield emulator
    finally:
        loop.call_soon_threadsafe(lambda: (emulator._shutdown(), stop.set()))
        thread.join(timeout)


@pytest.fixture
def kube_emulator() -> Iterator[KubeEmulator]:
    """A fresh emulator per test; the test fails if the emulator itself crashed on a request."""
    with running() as emulator:
        yield emulator
        crashes = list(emulator.errors)
    assert not crashes, f'the Kubernetes emulator crashed on requests: {crashes!r}'


@pytest.fixture
def kubeconfig(kube_emulator: KubeEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """KUBECONFIG points at the emulator (for kopf and `kubernetes.config.load_kube_config()`)."""
    import kubernetes
    saved = kubernetes.client.Configuration._default  # load_kube_config() replaces the global default
    path = kube_emulator.write_kubeconfig(tmp_path / 'kubeconfig')
    monkeypatch.setenv('KUBECONFIG', str(path))
    yield path
    kubernetes.client.Configuration._default = saved
