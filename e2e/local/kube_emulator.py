"""An emulated Kubernetes API (tests, the local cluster e2e, `make demo`): kmock 0.8 plus the API semantics
an operator relies on.

`KubeEmulator` serves a real HTTP Kubernetes API on a localhost port for kopf and the official client.
It keeps kmock's server, discovery, Status-shaped errors and reaction DSL (inject faults with
`emulator['post', kmock.resource('v1/pods')][:1] << 503`) and replaces its object store. Fixed in plain kmock:
- no server-assigned uid, resourceVersion, creationTimestamp, generation; create answers 200, not 201;
- labelSelector/fieldSelector ignored on list and watch; watch ignores resourceVersion;
- PATCH .../status patches the whole object; main-resource writes change .status;
- PUT answers 404; no 409 on a stale resourceVersion or an existing name; a failing json-patch `test`
  op answers 500 (kopf expects 422); a merge patch cannot delete a key with null;
- GET /api/v1/namespaces answers 500 (its URL parser), no `default` namespace, generateName answers 500,
  objects posted without metadata.namespace vanish from watches; no ownerReference garbage collection.
Added: the scale subresource, deletecollection, open-watch counts, a mutating-call counter.
Not emulated: kubelet, scheduler, controllers (tests play them), schema/CEL validation, admission,
server-side apply, strategic-merge list semantics (applied as a JSON merge patch), /openapi (kubectl
needs --validate=false), graceful pod deletion (pods go at once), dryRun, delete preconditions.
Pinned to kmock==0.8 internals: KubernetesScaffold, RawHandler._handle/_requests/_errors/_render_error,
rendering.Request/Response/StreamingError, parsing.ParsedPath/guess_k8s.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums, parsing, rendering

from e2e.local.kube_store import KubeStore, Obj, _api_version, _error, _scale

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


def _parse_path(path: str) -> parsing.ParsedPath | None:
    """Split a resource URL; None for discovery and other URLs, which kmock parses well."""
    parts = [part for part in path.split('/') if part]
    if len(parts) >= 3 and parts[0] == 'api':
        group, version, rest = '', parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == 'apis':
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None  # but /api/v1/namespaces/x/status is a namespace's own subresource
    if len(rest) >= 3 and rest[0] == 'namespaces' and rest[2] not in ('status', 'finalize'):
        namespace, rest = rest[1], rest[2:]
    name = rest[1] if len(rest) > 1 else None
    return parsing.ParsedPath(group, version, rest[0], namespace, name, '/'.join(rest[2:]) or None)


def _is_object_request(request: rendering.Request) -> bool:
    return request.resource is not None and request.resource.plural is not None


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesScaffold, KubeStore):
    """The emulated API. Start it with `running()` (tests: the `kube_emulator` fixture)."""

    base_url: str = attrs.field(default='', init=False)
    _objects_reaction: Any = attrs.field(default=None, init=False)
    _builtin_payloads: list[int] = attrs.field(factory=list, init=False)
    counts: collections.Counter[tuple[str, str, str | None]] = attrs.field(factory=collections.Counter, init=False)
    mutations: list[tuple[str, str, str | None, str | None, str | None]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # the scaffold: discovery, 404 for unknown URLs
        self._objects_reaction = self.fallback[_is_object_request] << self._serve
        self._builtin_payloads = [id(p) for p in self._payloads]
        for resource, kind, namespaced, subresources, shortnames in BUILTINS:
            self.declare(resource, kind, namespaced=namespaced, subresources=subresources, shortnames=shortnames)
        self.seed('namespaces', {'metadata': {'name': 'default'}})

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """kmock matches a request by scanning every earlier request per reaction (O(n) per request, so
        thousands of requests crawl). Object requests go straight to the store while a test has added no
        reactions of its own; with fault injection in place, kmock's matching decides as before."""
        if _is_object_request(request) and [id(p) for p in self._payloads] == self._builtin_payloads:
            return await self._objects_reaction(request)
        return await super()._handle(request)

    # -- for tests (any thread) ------------------------------------------------------------------
    def declare(self, resource: str, kind: str, *, namespaced: bool = True,
                subresources: tuple[str, ...] = (), shortnames: tuple[str, ...] = ()) -> None:
        """Serve a resource, e.g. declare('example.com/v1/widgets', 'Widget', subresources=('status',))."""
        self.resources[resource] = kmock.ResourceInfo(kind=kind, singular=kind.lower(), namespaced=namespaced,
                                                      verbs=VERBS, subresources=subresources, shortnames=shortnames)

    def objects(self, resource: str, namespace: str | None = None) -> list[Obj]:
        """Copies of the stored objects of a resource: 'pods', 'v1/pods', 'dstage', ..."""
        res = self._resource(resource)
        with self._lock:
            return [copy.deepcopy(o) for (r, ns, _), o in self._store.items() if r == res and namespace in (None, ns)]

    def get(self, resource: str, name: str, namespace: str = 'default') -> Obj | None:  # type: ignore[override]
        """A copy of one object or None. (It shadows kmock's HTTP shortcut `get`; use `request('GET', …)`.)"""
        res = self._resource(resource)
        with self._lock:
            return copy.deepcopy(self._store.get((res, namespace if self.resources[res].namespaced else None, name)))

    def watching(self, resource: str) -> int:
        """How many watches of a resource are open now: wait for one before racing an operator."""
        return self._watches[self._resource(resource)]

    @property
    def mutation_count(self) -> int:
        return len(self.mutations)

    def reset_counts(self) -> None:
        self.counts.clear()
        self.mutations.clear()

    def write_kubeconfig(self, path: str | Path) -> Path:
        def named(key: str, value: Any) -> list[dict[str, Any]]:
            return [{'name': 'emulator', key: value}]

        Path(path).write_text(json.dumps({
            'apiVersion': 'v1', 'kind': 'Config', 'current-context': 'emulator',
            'clusters': named('cluster', {'server': self.base_url}), 'users': named('user', {'token': 'emulator'}),
            'contexts': named('context', {'cluster': 'emulator', 'user': 'emulator', 'namespace': 'default'})}))
        return Path(path)

    def api_client(self) -> Any:
        """An official-client ApiClient for this emulator (no kubeconfig, no global configuration)."""
        import kubernetes
        configuration = kubernetes.client.Configuration()
        configuration.host = self.base_url
        return kubernetes.client.ApiClient(configuration)

    # -- HTTP ----------------------------------------------------------------------------------------
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """RawHandler.__call__ with our own URL parsing; API errors are answers, not crashes."""
        raw_response: aiohttp.web.StreamResponse | None = None
        try:
            k8s = _parse_path(raw.path)
            request = await (rendering.Request._parse(raw, id=len(self._requests)) if k8s is None
                             else self._parse(raw, k8s))
            self._requests.append(request)
            try:
                return await self._handle(request)
            except rendering.StreamingError as e:  # the response has already started streaming
                raw_response = e.args[0]
                raise (e.__cause__ or e) from None
        except Exception as e:  # noqa: BLE001 (every failure becomes an answer, as in kmock)
            if not isinstance(e, kmock.KubernetesError) and self._errors:
                self._errors[-1].append(e)  # an emulator bug: the `kube_emulator` fixture fails on it
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(e)
            await self._stream_error(e, raw_response)
            await raw_response.write_eof()
            return raw_response

    async def _parse(self, raw: aiohttp.web.BaseRequest, k8s: parsing.ParsedPath) -> rendering.Request:
        body = await raw.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        method, query = enums.method(raw.method), dict(raw.query)
        if verb := {'POST': 'create', 'PUT': 'update', 'PATCH': 'patch', 'DELETE': 'delete'}.get(raw.method):
            verb = 'deletecollection' if verb == 'delete' and k8s.name is None else verb
            self.counts[verb, k8s.plural, k8s.subresource] += 1
            self.mutations.append((verb, k8s.plural, k8s.namespace, k8s.name, k8s.subresource))
        return rendering.Request(
            id=len(self._requests), raw_request=raw, url=raw.url, method=method, params=query,
            headers=dict(raw.headers), cookies=dict(raw.cookies), body=body, text=body.decode('utf-8', 'replace'),
            data=data, action=parsing.guess_k8s(k8s, method, query), namespace=k8s.namespace, name=k8s.name,
            resource=kmock.resource(k8s.group, k8s.version, k8s.plural), subresource=k8s.subresource)

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        result = await super()._serve_version(request)  # fix kmock's "/v1" and its subresource entries:
        for entry in result['resources']:  # their short names made kubectl warn of ambiguity
            if '/' in entry['name']:
                entry.update(shortNames=[], verbs=['get', 'patch', 'update'])
        return {**result, 'groupVersion': _api_version(request.resource)}

    async def _serve(self, request: rendering.Request) -> rendering.Response:
        # The status is always explicit: kmock 0.8 copies the status of a Response returned by a callback
        # onto the reaction itself, so a single 201 would stick to every later answer.
        status, payload = self._answer(request)
        return rendering.Response(status=status, payload=payload)

    def _answer(self, request: rendering.Request) -> tuple[int, Any]:
        res, method, sub = request.resource, request.method.value, request.subresource
        if res not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        info = self.resources[res]
        if sub is not None and sub not in info.subresources:
            raise _error(404, 'NotFound', f'the server could not find the requested resource ({sub})')
        if method == 'GET' and request.params.get('watch') in ('true', '1'):
            return 200, self._watch(request)
        with self._lock:
            if request.name is None and method in ('GET', 'DELETE'):
                keys = [k for k, o in self._store.items() if k[0] == res and self._selected(request, o)]
                items = [self._delete(k) if method == 'DELETE' else copy.deepcopy(self._store[k])
                         for k in keys if k in self._store]
                return 200, {'apiVersion': _api_version(res), 'kind': f'{info.kind}List',
                             'metadata': {'resourceVersion': str(self._rv)}, 'items': items}
            if request.name is None and method == 'POST':
                return 201, self._create(request)
            key = (res, request.namespace if info.namespaced else None, request.name)
            if key not in self._store:
                raise _error(404, 'NotFound', f'{res.plural} "{request.name}" not found', name=request.name)
            if method in ('PUT', 'PATCH'):
                obj = self._write(key, request)
            elif method == 'DELETE':
                options = request.data if isinstance(request.data, dict) else {}
                policy = options.get('propagationPolicy') or request.params.get('propagationPolicy')
                obj = self._delete(key, orphan=policy == 'Orphan')
            else:
                obj = copy.deepcopy(self._store[key])
            return 200, _scale(obj) if sub == 'scale' else obj


@contextlib.contextmanager
def running(emulator: KubeEmulator | None = None, *, timeout: float = 10) -> Iterator[KubeEmulator]:
    """Serve the emulator on a free localhost port from a thread with its own event loop."""
    emulator = KubeEmulator() if emulator is None else emulator
    loop, ready, stop, failures = asyncio.new_event_loop(), threading.Event(), asyncio.Event(), []

    async def serve() -> None:
        async with emulator, kmock.Server(emulator) as server:
            emulator.base_url = f'http://{server.host}:{server.port}'
            ready.set()
            await stop.wait()
            emulator._closing = True  # end the open watches
            emulator._notify()

    def main() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as e:  # noqa: BLE001 (reported to the starting thread)
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
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)

