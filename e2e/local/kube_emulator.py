"""An emulated Kubernetes API (tests, the local cluster e2e, `make demo`, `make cluster`): kmock 0.8 plus the
API semantics an operator and kubectl rely on.

`KubeEmulator` serves a real HTTP Kubernetes API on a localhost port for kopf, the official client and the
real `kubectl`. It keeps kmock's server, Status-shaped errors and reaction DSL (inject faults with
`emulator['post', kmock.resource('v1/pods')][:1] << 503`); the objects live in `KubeStore`. Fixed in plain kmock:
- no server-assigned uid, resourceVersion, creationTimestamp, generation; create answers 200, not 201;
- labelSelector/fieldSelector ignored on list and watch; watch ignores resourceVersion;
- PATCH .../status patches the whole object; main-resource writes change .status;
- PUT answers 404; no 409 on a stale resourceVersion or an existing name; a failing json-patch `test`
  op answers 500 (kopf expects 422); a merge patch cannot delete a key with null;
- GET /api/v1/namespaces answers 500 (its URL parser), no `default` namespace, generateName answers 500,
  objects posted without metadata.namespace vanish from watches; no ownerReference garbage collection;
- watches answer application/octet-stream (kubectl: "no stream serializers registered").
Added: custom resources registered from CRD objects (`register_crd`, `register_crds(folder)`, or a CRD posted to
the API), with admission as kube-apiserver does it (admission.py: pruning, defaults, schema, CEL rules, 422
Invalid Status bodies, `fieldValidation`); `/openapi/v3` and `/openapi/v2` (openapi.py); server-side Tables
(tables.py); `/version` (1.31); `pods/log` from the local kubelet's files (pod_logs.py); a Secret's `stringData`
merged into `data`; the scale subresource, `pods/eviction` honouring PodDisruptionBudgets (eviction.py),
deletecollection, open-watch counts, a mutating-call counter.
Not emulated: kubelet, scheduler, controllers (tests and the pod runner play them), server-side apply,
strategic-merge list semantics (applied as a JSON merge patch), graceful pod deletion (pods go at once),
dryRun, delete preconditions, protobuf, aggregated discovery (kubectl falls back to the legacy documents),
removing a resource when its CRD is deleted.
Pinned to kmock==0.8 internals (this module only): KubernetesScaffold, RawHandler._handle/_requests/_errors/
_render_error, rendering.Request/Response/StreamingError, parsing.ParsedPath/guess_k8s.
"""
from __future__ import annotations

import asyncio
import base64
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
import yaml
from kmock._internal import enums, parsing, rendering

from e2e.local import openapi, pod_logs, service_proxy, tables
from e2e.local.custom_resources import CLUSTER_CRDS, REPO_CRDS, CustomResource, CustomResources
from e2e.local.kube_store import Call, KubeStore, Obj, _api_version, _labels_match

VERBS = ('create', 'delete', 'deletecollection', 'get', 'list', 'patch', 'update', 'watch')
BUILTINS = [  # resource, kind, namespaced, subresources, short names
    ('v1/namespaces', 'Namespace', False, ('status',), ('ns',)),
    ('v1/nodes', 'Node', False, ('status',), ('no',)),
    ('v1/pods', 'Pod', True, ('status', 'eviction'), ('po',)),
    ('v1/services', 'Service', True, ('status',), ('svc',)),
    ('v1/configmaps', 'ConfigMap', True, (), ('cm',)),
    ('v1/secrets', 'Secret', True, (), ()),
    ('v1/persistentvolumeclaims', 'PersistentVolumeClaim', True, ('status',), ('pvc',)),
    ('v1/events', 'Event', True, (), ('ev',)),
    ('networking.k8s.io/v1/networkpolicies', 'NetworkPolicy', True, (), ('netpol',)),
    ('coordination.k8s.io/v1/leases', 'Lease', True, (), ()),
    ('policy/v1/poddisruptionbudgets', 'PodDisruptionBudget', True, ('status',), ('pdb',)),
    ('resource.k8s.io/v1/resourceslices', 'ResourceSlice', False, (), ()),
    ('resource.k8s.io/v1/deviceclasses', 'DeviceClass', False, (), ()),
    ('resource.k8s.io/v1/resourceclaimtemplates', 'ResourceClaimTemplate', True, (), ()),
    ('resource.k8s.io/v1/resourceclaims', 'ResourceClaim', True, ('status',), ()),
    ('apiextensions.k8s.io/v1/customresourcedefinitions', 'CustomResourceDefinition', False, ('status',), ('crd',)),
    ('kopf.dev/v1/kopfpeerings', 'KopfPeering', True, (), ()),
    ('kopf.dev/v1/clusterkopfpeerings', 'ClusterKopfPeering', False, (), ()),
]
SUBRESOURCE_KINDS = {'status': None, 'scale': ('autoscaling', 'v1', 'Scale'),  # None: the resource's own kind
                     'eviction': ('policy', 'v1', 'Eviction')}


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


def _json(payload: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(text=json.dumps(payload), status=status, content_type='application/json')


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesScaffold, CustomResources, KubeStore):
    """The emulated API. Start it with `running()` (tests: the `kube_emulator` fixture)."""

    base_url: str = attrs.field(default='', init=False)
    custom: dict[kmock.resource, CustomResource] = attrs.field(factory=dict, init=False)
    _objects_reaction: Any = attrs.field(default=None, init=False)
    _builtin_payloads: list[int] = attrs.field(factory=list, init=False)
    counts: collections.Counter[tuple[str, str, str | None]] = attrs.field(factory=collections.Counter, init=False)
    mutations: list[tuple[str, str, str | None, str | None, str | None]] = attrs.field(factory=list, init=False)
    # mutating admission webhooks, as a cluster's (Kueue gates the pods it queues): (plural, new object) → object
    webhooks: list[Any] = attrs.field(factory=list, init=False)
    # the kubelet's logs that `pods/log` serves (a container_logs.ContainerLogs; the local cluster sets it)
    logs: Any = attrs.field(default=None, init=False)

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

    def _admit(self, request: Call, obj: Obj, old: Obj | None) -> Obj:
        if old is None:  # a create: the webhooks see it before validation, as mutating admission does
            for webhook in list(self.webhooks):
                obj = webhook(request.resource.plural, obj)
        if request.resource.plural == 'secrets' and request.subresource is None and 'stringData' in obj:
            string_data = obj.pop('stringData') or {}  # write-only, merged into data as the API server does
            obj['data'] = {**(obj.get('data') or {}), **{k: base64.b64encode(str(v).encode()).decode()
                                                          for k, v in string_data.items()}}
        return super()._admit(request, obj, old)

    # -- for tests (any thread) ------------------------------------------------------------------
    def declare(self, resource: str, kind: str, *, namespaced: bool = True,
                subresources: tuple[str, ...] = (), shortnames: tuple[str, ...] = (),
                categories: tuple[str, ...] = ()) -> None:
        """Serve a resource, e.g. declare('example.com/v1/widgets', 'Widget', subresources=('status',))."""
        self.resources[resource] = kmock.ResourceInfo(kind=kind, singular=kind.lower(), namespaced=namespaced,
                                                      verbs=VERBS, subresources=subresources, shortnames=shortnames,
                                                      categories=categories)

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

    def write_kubeconfig(self, path: str | Path, namespace: str = 'default') -> Path:
        def named(key: str, value: Any) -> list[dict[str, Any]]:
            return [{'name': 'diffstage-local', key: value}]

        Path(path).write_text(json.dumps({
            'apiVersion': 'v1', 'kind': 'Config', 'current-context': 'diffstage-local',
            'clusters': named('cluster', {'server': self.base_url}), 'users': named('user', {'token': 'emulator'}),
            'contexts': named('context', {'cluster': 'diffstage-local', 'user': 'diffstage-local',
                                          'namespace': namespace})}))
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
        if (document := self._document(raw)) is not None:
            return document
        if (match := service_proxy.PATH.match(raw.path)) is not None:
            return await service_proxy.proxy(raw, match, self._service_and_pods)
        if (match := pod_logs.PATH.match(raw.path)) is not None:
            return await pod_logs.serve(raw, match, lambda ns, name: self.get('pods', name, ns), self.logs,
                                        lambda: self._closing)
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

    def _service_and_pods(self, namespace: str, name: str) -> tuple[Obj | None, list[Obj]]:
        with self._lock:
            service = copy.deepcopy(self._store.get((self._resource('services'), namespace, name)))
            if service is None:
                return None, []
            selector = ','.join(f'{k}={v}' for k, v in sorted((service['spec'].get('selector') or {}).items()))
            pods = [copy.deepcopy(o) for (r, ns, _), o in self._store.items() if r.plural == 'pods' and ns == namespace
                    and selector and _labels_match(selector, o['metadata'].get('labels') or {})]
        return service, pods

    def _kinds(self) -> list[openapi.Kind]:
        out = []
        for res, info in list(self.resources.items()):
            custom = self.custom.get(res)
            out.append(openapi.Kind(res.group, res.version, info.kind, res.plural, bool(info.namespaced),
                                    tuple(info.subresources), custom.schema if custom else None))
        return out

    def _document(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.Response | None:
        """/version and the OpenAPI documents; None for every other URL."""
        if raw.method != 'GET':
            return None
        if raw.path == '/version':
            return _json(openapi.VERSION)
        if raw.path == '/openapi/v3':
            return _json(openapi.v3_index(self._kinds()))
        if raw.path.startswith('/openapi/v3/'):
            members = openapi.by_group_version(self._kinds()).get(raw.path[len('/openapi/v3/'):])
            if members is None:
                return _json(_status(404, 'NotFound', 'the server could not find the requested resource'), 404)
            return _json(openapi.group_version_document(members))
        if raw.path == '/openapi/v2':
            accept = raw.headers.get('Accept', 'application/json')
            if 'json' not in accept and '*/*' not in accept:
                return _json(_status(406, 'NotAcceptable', 'only application/json is served (no protobuf)'), 406)
            return _json(openapi.v2_document(self._kinds()))
        return None

    async def _parse(self, raw: aiohttp.web.BaseRequest, k8s: parsing.ParsedPath) -> rendering.Request:
        body = await raw.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            try:  # kubectl may send YAML-free JSON only, but a hand-written client may send YAML
                data = yaml.safe_load(body) if body else None
            except yaml.YAMLError:
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
                entry.update(shortNames=[], categories=[], verbs=['get', 'patch', 'update'])
                if kind := SUBRESOURCE_KINDS.get(entry['name'].split('/', 1)[1]):
                    entry.update(group=kind[0], version=kind[1], kind=kind[2])
        return {**result, 'groupVersion': _api_version(request.resource)}

    async def _serve(self, request: rendering.Request) -> rendering.Response:
        # The status is always explicit: kmock 0.8 copies the status of a Response returned by a callback
        # onto the reaction itself, so a single 201 would stick to every later answer.
        call = Call(request.method.value, request.resource, request.namespace, request.name, request.subresource,
                    request.data, request.params, request.headers.get('Content-Type', ''))
        status, payload = self.answer(call)
        accept = request.headers.get('Accept', '')
        if tables.wants_table(accept) and call.method == 'GET' and call.subresource is None:
            payload = self._table(call, payload)
        # Every header of an answer is named on every answer: kmock 0.8 merges a callback's headers into the
        # reaction itself, so a header sent once (a Warning) stuck to every later answer; None sends nothing.
        headers: dict[str, str | None] = {'Content-Type': 'application/json', 'Warning': None}
        if call.warnings:  # RFC 7234 warn-code 299, as kube-apiserver sends them (kubectl prints "Warning: ...")
            headers['Warning'] = ', '.join(f'299 - {json.dumps(w)}' for w in call.warnings)
        return rendering.Response(status=status, payload=payload, headers=headers)

    def _table(self, call: Call, payload: Any) -> Any:
        custom = self.custom.get(call.resource)
        if custom is not None:
            columns = tables.crd_columns(custom.printer_columns)
        else:
            columns = tables.BUILTIN_COLUMNS.get(call.resource.plural, tables.DEFAULT_COLUMNS)
        include = call.params.get('includeObject', 'Metadata')
        if call.watch:
            return self._table_watch(payload, columns, include)
        if isinstance(payload, dict) and payload.get('kind', '').endswith('List') and 'items' in payload:
            return tables.table(columns, payload['items'], include, payload['metadata'].get('resourceVersion', ''))
        return tables.table(columns, [payload], include, payload['metadata'].get('resourceVersion', ''))

    @staticmethod
    async def _table_watch(events: Any, columns: list[tables.Column], include: str) -> Any:
        first = True
        async for event in events:
            if isinstance(event, dict) and isinstance(event.get('object'), dict):
                obj = event['object']
                event = {**event, 'object': tables.table(columns, [obj], include,
                                                         obj['metadata'].get('resourceVersion', ''), headers=first)}
                first = False
            yield event


def _status(code: int, reason: str, message: str) -> Obj:
    return {'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure', 'message': message,
            'reason': reason, 'code': code}


@contextlib.contextmanager
def running(emulator: KubeEmulator | None = None, *, crds: str | Path | None = REPO_CRDS, port: int | None = None,
            timeout: float = 10) -> Iterator[KubeEmulator]:
    """Serve the emulator on localhost (a free port unless given) from a thread with its own event loop, with
    the CRDs of a folder registered (the repository's crds/ by default, with the other projects' CRDs of
    e2e/local/crds: the InferencePool; None: none)."""
    emulator = KubeEmulator() if emulator is None else emulator
    if crds is not None:
        emulator.register_crds(crds)
        if crds == REPO_CRDS:
            emulator.register_crds(CLUSTER_CRDS)
    loop, ready, stop, failures = asyncio.new_event_loop(), threading.Event(), asyncio.Event(), []

    async def serve() -> None:
        async with emulator, kmock.Server(emulator, port=port) as server:
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

