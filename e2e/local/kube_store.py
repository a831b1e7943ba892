"""The object store behind `KubeEmulator`: the API semantics, pure Python, no HTTP.

resourceVersion/uid/generation/timestamps, label and field selectors, status isolation, 409s,
json/merge patches, generateName, namespaces, finalizers, ownerReference GC, watch event fan-out.
It speaks `Call` (a request as plain data) and answers `(status, payload)`; errors are `kmock.KubernetesError`
(kmock's public API), which the emulator renders as Status bodies. Admission is a hook (`_admit`).
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
import dataclasses
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import attrs
import jsonpatch
import jsonpointer
import kmock

from e2e.local import eviction

NAMESPACES, PODS = kmock.resource('v1/namespaces'), kmock.resource('v1/pods')
INITIAL_STATUS = {PODS: {'phase': 'Pending'}, NAMESPACES: {'phase': 'Active'}}
SERVER_OWNED = ('name', 'namespace', 'uid', 'creationTimestamp', 'deletionTimestamp', 'generation', 'resourceVersion')
Key = tuple[kmock.resource, str | None, str]
Obj = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Call:
    """One API request as the store sees it."""

    method: str  # GET, POST, PUT, PATCH, DELETE
    resource: kmock.resource
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    body: Any = None  # the decoded JSON body
    params: Mapping[str, str] = dataclasses.field(default_factory=dict)
    content_type: str = ''
    warnings: list[str] = dataclasses.field(default_factory=list)  # admission's, sent as `Warning` headers

    @property
    def watch(self) -> bool:
        return self.method == 'GET' and self.params.get('watch') in ('true', '1')


def _error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details or {'reason': reason})


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ')


def _api_version(res: kmock.resource) -> str:
    return f'{res.group}/{res.version}' if res.group else res.version


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


def _fields_match(selector: str, obj: Obj) -> bool:
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


def _without_status(obj: Obj, status: Any = None) -> Obj:
    result = {key: value for key, value in obj.items() if key != 'status'}
    return result if status is None else {**result, 'status': copy.deepcopy(status)}


def _spec(obj: Obj) -> Obj:  # whatever moves the generation
    return {k: v for k, v in obj.items() if k not in ('apiVersion', 'kind', 'metadata', 'status')}


def _scale(obj: Obj) -> Obj:
    meta, spec, status = obj['metadata'], obj.get('spec') or {}, obj.get('status') or {}
    return {'apiVersion': 'autoscaling/v1', 'kind': 'Scale',
            'metadata': {k: meta[k] for k in ('name', 'namespace', 'uid', 'resourceVersion') if k in meta},
            'spec': {'replicas': spec.get('replicas', 0)},
            'status': {'replicas': status.get('replicas', 0), 'selector': status.get('selector', '')}}


@attrs.define(kw_only=True, slots=False)
class KubeStore:
    """The objects and their change log; a mixin for a kmock handler that has `resources`."""

    _store: dict[Key, Obj] = attrs.field(factory=dict, init=False)
    _log: list[tuple[int, kmock.resource, Obj | None, Obj | None]] = attrs.field(factory=list, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _lock: threading.RLock = attrs.field(factory=threading.RLock, init=False)
    _loop: asyncio.AbstractEventLoop | None = attrs.field(default=None, init=False)
    _wakeup: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _watches: collections.Counter[kmock.resource] = attrs.field(factory=collections.Counter, init=False)

    def seed(self, resource: str, obj: Obj) -> Obj:
        """Store an object as given, status included (nodes, running pods), plus server-assigned fields."""
        res, obj = self._resource(resource), copy.deepcopy(obj)
        meta = obj.setdefault('metadata', {})
        meta['namespace'] = meta.get('namespace', 'default') if self.resources[res].namespaced else None
        with self._lock:
            if (res, meta['namespace'], meta['name']) in self._store:
                raise ValueError(f'{res.plural} {meta["name"]!r} already exists')
            return self._insert(res, obj)

    def _resource(self, resource: str | kmock.resource) -> kmock.resource:
        res = resource if isinstance(resource, kmock.resource) else kmock.resource(resource)
        if res.version is None:  # a bare plural or a short name
            res = next((r for r in self.resources if res.plural in (r.plural, *self.resources[r].shortnames)), res)
        if res not in self.resources:
            raise KeyError(f'resource {resource!r} is not declared')
        return res

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, res: kmock.resource, before: Obj | None, after: Obj | None) -> None:
        self._log.append((self._rv, res, copy.deepcopy(before), copy.deepcopy(after)))
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is watching
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._notify)

    def _notify(self) -> None:  # in the server's loop: wake every watch
        self._wakeup, wakeup = asyncio.Event(), self._wakeup
        wakeup.set()

    def _selected(self, request: Call, obj: Obj) -> bool:
        meta, params = obj['metadata'], request.params
        return bool(request.namespace in (None, meta.get('namespace')) and request.name in (None, meta['name'])
                    and _labels_match(params.get('labelSelector', ''), meta.get('labels') or {})
                    and _fields_match(params.get('fieldSelector', ''), obj))

    def answer(self, request: Call) -> tuple[int, Any]:
        """(HTTP status, payload) of one call; a watch's payload is an async iterator of events."""
        res, method, sub = request.resource, request.method, request.subresource
        if res not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        info = self.resources[res]
        if sub is not None and sub not in info.subresources:
            raise _error(404, 'NotFound', f'the server could not find the requested resource ({sub})')
        if request.watch:
            return 200, self._watch(request)
        with self._lock:
            if request.name is None and method in ('GET', 'DELETE'):
                # by namespace and name, as a real API server lists (etcd's key order): kubectl prints rows so
                keys = sorted((k for k, o in self._store.items() if k[0] == res and self._selected(request, o)),
                              key=lambda k: (k[1] or '', k[2]))
                items = [self._delete(k) if method == 'DELETE' else copy.deepcopy(self._store[k])
                         for k in keys if k in self._store]
                return 200, {'apiVersion': _api_version(res), 'kind': f'{info.kind}List',
                             'metadata': {'resourceVersion': str(self._rv)}, 'items': items}
            if request.name is None and method == 'POST':
                return 201, self._create(request)
            key = (res, request.namespace if info.namespaced else None, request.name)
            if key not in self._store:
                raise _error(404, 'NotFound', f'{res.plural} "{request.name}" not found', name=request.name)
            if sub == 'eviction' and method == 'POST':
                return self._evict(key)
            if method in ('PUT', 'PATCH'):
                obj = self._write(key, request)
            elif method == 'DELETE':
                options = request.body if isinstance(request.body, dict) else {}
                policy = options.get('propagationPolicy') or request.params.get('propagationPolicy')
                obj = self._delete(key, orphan=policy == 'Orphan')
            else:
                obj = copy.deepcopy(self._store[key])
            return 200, _scale(obj) if sub == 'scale' else obj

    def _evict(self, key: Key) -> tuple[int, Any]:
        """pods/eviction (eviction.py): 429 if a PodDisruptionBudget forbids it, else DisruptionTarget + delete."""
        pod, namespace = self._store[key], key[1]
        in_namespace = [o for k, o in self._store.items() if k[1] == namespace]
        pods = [o for o in in_namespace if o.get('kind') == 'Pod']
        why = eviction.refusal(pod, [o for o in in_namespace if o.get('kind') == 'PodDisruptionBudget'], pods)
        if why is not None:
            raise _error(429, 'TooManyRequests', why, name=key[2])
        status = copy.deepcopy(pod.get('status') or {})
        status['conditions'] = [*(status.get('conditions') or ()), eviction.disruption_target(_now())]
        self._update(key, {**pod, 'status': status})
        self._delete(key)
        return 201, {'kind': 'Status', 'apiVersion': 'v1', 'status': 'Success', 'code': 201}

    def _create(self, request: Call) -> Obj:
        res, info, obj = request.resource, self.resources[request.resource], copy.deepcopy(request.body)
        if not isinstance(obj, dict):
            raise _error(400, 'BadRequest', 'the body must be a JSON object')
        meta = obj['metadata'] = {k: v for k, v in (obj.get('metadata') or {}).items() if k not in SERVER_OWNED[2:]}
        if info.namespaced:
            if request.namespace and meta.get('namespace', request.namespace) != request.namespace:
                raise _error(400, 'BadRequest', 'the namespace of the object does not match the URL')
            meta['namespace'] = namespace = request.namespace or meta.get('namespace')
            if (NAMESPACES, None, namespace) not in self._store:
                raise _error(404, 'NotFound', f'namespaces "{namespace}" not found', name=namespace)
        else:
            meta['namespace'] = None
        if not meta.get('name'):
            if not meta.get('generateName'):
                raise _error(422, 'Invalid', 'metadata.name or metadata.generateName is required')
            meta['name'] = meta['generateName'] + ''.join(random.choices('bcdfghjklmnpqrstvwxz2456789', k=5))
        if (res, meta['namespace'], meta['name']) in self._store:
            raise _error(409, 'AlreadyExists', f'{res.plural} "{meta["name"]}" already exists', name=meta['name'])
        obj = _without_status(obj) if 'status' in info.subresources else obj
        return self._insert(res, self._admit(request, obj, None))

    def _insert(self, res: kmock.resource, obj: Obj) -> Obj:
        meta = obj['metadata']
        if meta['namespace'] is None:
            del meta['namespace']
        obj.update(apiVersion=_api_version(res), kind=self.resources[res].kind)
        if 'status' not in obj and res in INITIAL_STATUS:
            obj['status'] = copy.deepcopy(INITIAL_STATUS[res])
        meta.setdefault('uid', str(uuid.uuid4()))
        meta.setdefault('creationTimestamp', _now())
        meta.update(generation=1, resourceVersion=self._bump())
        self._store[res, meta.get('namespace'), meta['name']] = obj
        self._emit(res, None, obj)
        return copy.deepcopy(obj)

    def _write(self, key: Key, request: Call) -> Obj:
        """PUT or PATCH the object, its status, or its scale."""
        old, sub, content_type = self._store[key], request.subresource, request.content_type
        current = _scale(old) if sub == 'scale' else old
        if request.method == 'PUT':
            new = request.body
            if isinstance(new, dict) and (new.get('metadata') or {}).get('name', key[2]) != key[2]:
                raise _error(400, 'BadRequest', 'the name of the object does not match the URL')
        elif 'json-patch' in content_type:
            try:
                new = jsonpatch.apply_patch(current, request.body)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, TypeError) as e:
                raise _error(422, 'Invalid', f'json patch failed: {e}') from e  # a failed `test` op too
        elif 'merge-patch' in content_type:  # strategic merge patches included
            new = _merge_patch(current, request.body)
        else:
            raise _error(415, 'UnsupportedMediaType', f'unsupported patch type: {content_type!r}')
        if not isinstance(new, dict):
            raise _error(400, 'BadRequest', 'the body must be a JSON object')
        if (rv := (new.get('metadata') or {}).get('resourceVersion')) and rv != old['metadata']['resourceVersion']:
            raise _error(409, 'Conflict', 'the object has been modified; please apply your changes to the '
                                          'latest version and try again', name=key[2])
        if sub == 'scale':
            new = {**old, 'spec': {**(old.get('spec') or {}), 'replicas': (new.get('spec') or {}).get('replicas')}}
        elif sub == 'status':
            new = _without_status(old, new.get('status'))
        elif 'status' in self.resources[key[0]].subresources:
            new = _without_status(new, old.get('status'))
        return self._update(key, self._admit(request, copy.deepcopy(new), old))

    def _admit(self, request: Call, obj: Obj, old: Obj | None) -> Obj:
        """Admission (a subclass prunes, defaults and validates): the object to store, or a KubernetesError."""
        return obj

    def _update(self, key: Key, new: Obj) -> Obj:
        old, new = self._store[key], copy.deepcopy(new)
        old_meta = old['metadata']
        meta = new['metadata'] = new['metadata'] if isinstance(new.get('metadata'), dict) else {}
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

    def _delete(self, key: Key, orphan: bool = False) -> Obj:
        obj = self._store[key]
        meta = obj['metadata']
        if not meta.get('finalizers'):
            return self._remove(key, orphan)
        if not meta.get('deletionTimestamp'):  # the finalizers hold it: mark it, and their owners release it
            old = copy.deepcopy(obj)
            meta.update(deletionTimestamp=_now(), resourceVersion=self._bump())
            self._emit(key[0], old, obj)
        return copy.deepcopy(obj)

    def _remove(self, key: Key, orphan: bool = False) -> Obj:
        """Remove for good, then collect dependents left without a live owner, and a namespace's content."""
        obj = self._store.pop(key)
        obj['metadata']['resourceVersion'] = self._bump()
        self._emit(key[0], obj, None)
        uid = obj['metadata'].get('uid')
        for dkey, dependent in list(self._store.items()):
            refs = dependent['metadata'].get('ownerReferences') or []
            in_namespace = key[0] == NAMESPACES and dkey[1] == key[2]
            owned = not orphan and any(ref.get('uid') == uid for ref in refs)
            if dkey in self._store and (in_namespace or owned and not self._owners_alive(refs)):
                self._delete(dkey)
        return copy.deepcopy(obj)

    def _owners_alive(self, refs: list[Obj]) -> bool:
        live = {o['metadata'].get('uid') for o in self._store.values()}
        return any(ref.get('uid') in live for ref in refs)

    async def _watch(self, request: Call) -> Any:
        yield b''  # send the headers now: a quiet watch is still a started watch
        loop, res, params = asyncio.get_running_loop(), request.resource, request.params
        deadline = loop.time() + float(params['timeoutSeconds']) if params.get('timeoutSeconds') else None
        since = params.get('resourceVersion') or '0'
        with self._lock:
            if since == '0' or not since.isdigit():  # "any version": the current objects, then changes
                position = len(self._log)
                initial = [copy.deepcopy(o) for k, o in self._store.items()
                           if k[0] == res and self._selected(request, o)]
            else:  # exactly the changes after that resourceVersion
                position, initial = bisect.bisect_right(self._log, int(since), key=lambda e: e[0]), []
        self._watches[res] += 1
        try:
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
                if deadline is not None and deadline <= loop.time():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), None if deadline is None else deadline - loop.time())
        finally:
            self._watches[res] -= 1
