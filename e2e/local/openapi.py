"""The OpenAPI documents kubectl reads: `/openapi/v3` (the index of group-versions) and one document per
group-version (`/openapi/v3/apis/<group>/<version>`), built from the served resources. A custom resource's
schema is its CRD's `openAPIV3Schema` (metadata as a reference to ObjectMeta, as kube-apiserver publishes
it), a built-in kind is an object with its metadata and unknown fields preserved (the emulator does not carry
the Kubernetes type definitions). Each kind carries `x-kubernetes-group-version-kind`, which is what
`kubectl explain` and kubectl's field-validation check look for; each path lists `fieldValidation`, so
kubectl leaves validation to the server (`--validate=strict` → `?fieldValidation=Strict`).

`/openapi/v2` is served as JSON (Swagger 2.0) to a client that accepts JSON; kubectl asks for protobuf
only, gets 406 and uses v3 (this emulator does not encode protobuf).
"""
from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]
OBJECT_META = 'io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta'
VERSION = {'major': '1', 'minor': '31', 'gitVersion': 'v1.31.0-diffstage-emulator', 'gitTreeState': 'clean',
           'gitCommit': '0000000000000000000000000000000000000000', 'buildDate': '2026-12-01T00:00:00Z',
           'goVersion': 'go1.22.5', 'compiler': 'gc', 'platform': 'linux/amd64', 'emulationMajor': '1',
           'emulationMinor': '31'}
_META_SCHEMA: Obj = {
    'description': 'ObjectMeta is metadata that all persisted resources must have, which includes all objects '
                   'users must create.',
    'type': 'object',
    'properties': {
        'name': {'type': 'string', 'description': 'Name must be unique within a namespace.'},
        'generateName': {'type': 'string', 'description': 'An optional prefix the server uses to generate a '
                                                          'unique name, if name is not provided.'},
        'namespace': {'type': 'string', 'description': 'The namespace the object is in.'},
        'uid': {'type': 'string', 'description': 'The unique in time and space value for this object.'},
        'resourceVersion': {'type': 'string', 'description': 'The internal version of this object.'},
        'generation': {'type': 'integer', 'format': 'int64', 'description': 'A sequence number representing a '
                                                                           'specific generation of the desired state.'},
        'creationTimestamp': {'type': 'string', 'format': 'date-time', 'description': 'When it was created.'},
        'deletionTimestamp': {'type': 'string', 'format': 'date-time', 'description': 'When it will be deleted.'},
        'labels': {'type': 'object', 'additionalProperties': {'type': 'string', 'default': ''},
                   'description': 'Map of string keys and values to organize and categorize objects.'},
        'annotations': {'type': 'object', 'additionalProperties': {'type': 'string', 'default': ''},
                        'description': 'An unstructured key value map set by external tools.'},
        'finalizers': {'type': 'array', 'items': {'type': 'string', 'default': ''},
                       'description': 'Must be empty before the object is deleted from the registry.'},
        'ownerReferences': {'type': 'array', 'items': {'type': 'object', 'x-kubernetes-preserve-unknown-fields': True},
                            'description': 'Objects depended by this object.'},
    },
}


@dataclass(frozen=True)
class Kind:
    """One served resource as the documents need it."""

    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool
    subresources: tuple[str, ...]
    schema: Obj | None  # a CRD's openAPIV3Schema; None: a built-in kind (unknown fields preserved)

    @property
    def gv_path(self) -> str:
        return f'apis/{self.group}/{self.version}' if self.group else f'api/{self.version}'

    @property
    def definition(self) -> str:
        if not self.group:
            return f'io.k8s.api.core.{self.version}.{self.kind}'
        return '.'.join([*reversed(self.group.split('.')), self.version, self.kind])


def _kind_schema(kind: Kind) -> Obj:
    schema = copy.deepcopy(kind.schema) if kind.schema is not None else {
        'type': 'object', 'x-kubernetes-preserve-unknown-fields': True,
        'properties': {'apiVersion': {'type': 'string'}, 'kind': {'type': 'string'}},
        'description': f'{kind.kind} (the emulated API keeps the built-in kinds\' fields unchecked).'}
    schema.setdefault('properties', {})['metadata'] = {
        'allOf': [{'$ref': f'#/components/schemas/{OBJECT_META}'}], 'default': {},
        'description': "Standard object's metadata. More info: "
                       'https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#metadata'}
    props = schema['properties']
    props.setdefault('apiVersion', {}).setdefault('description', 'APIVersion defines the versioned schema of this '
                                                                 'representation of an object.')
    props.setdefault('kind', {}).setdefault('description', 'Kind is a string value representing the REST resource '
                                                           'this object represents.')
    schema['x-kubernetes-group-version-kind'] = [{'group': kind.group, 'kind': kind.kind, 'version': kind.version}]
    return schema


def _paths(kind: Kind) -> Obj:
    base = f'/{kind.gv_path}/' + ('namespaces/{namespace}/' if kind.namespaced else '') + kind.plural
    ref = {'$ref': f'#/components/schemas/{kind.definition}'}
    answer = {'200': {'description': 'OK', 'content': {'application/json': {'schema': ref}}}}
    validation = {'name': 'fieldValidation', 'in': 'query', 'schema': {'type': 'string', 'uniqueItems': True},
                  'description': 'How the server treats unknown or duplicate fields: Ignore, Warn or Strict.'}
    gvk = {'group': kind.group, 'version': kind.version, 'kind': kind.kind}
    write = {'parameters': [validation], 'responses': answer, 'x-kubernetes-group-version-kind': gvk}
    item = {'get': {'responses': answer, 'x-kubernetes-action': 'get', 'x-kubernetes-group-version-kind': gvk},
            'put': {**write, 'x-kubernetes-action': 'put'}, 'patch': {**write, 'x-kubernetes-action': 'patch'},
            'delete': {'responses': answer, 'x-kubernetes-action': 'delete'}}
    paths = {base: {'get': {'responses': answer, 'x-kubernetes-action': 'list'},
                    'post': {**write, 'x-kubernetes-action': 'post'}},
             base + '/{name}': item}
    for sub in kind.subresources:
        paths[f'{base}/{{name}}/{sub}'] = item
    return paths


def group_version_document(kinds: Iterable[Kind]) -> Obj:
    kinds = list(kinds)
    schemas = {OBJECT_META: _META_SCHEMA, **{k.definition: _kind_schema(k) for k in kinds}}
    paths: Obj = {}
    for kind in kinds:
        paths.update(_paths(kind))
    return {'openapi': '3.0.0', 'info': {'title': 'Kubernetes', 'version': VERSION['gitVersion']},
            'paths': paths, 'components': {'schemas': schemas}}


def by_group_version(kinds: Iterable[Kind]) -> dict[str, list[Kind]]:
    out: dict[str, list[Kind]] = {}
    for kind in kinds:
        out.setdefault(kind.gv_path, []).append(kind)
    return out


def v3_index(kinds: Iterable[Kind]) -> Obj:
    """`/openapi/v3`: each group-version with the URL of its document (the hash changes with the content)."""
    paths = {}
    for gv, members in sorted(by_group_version(kinds).items()):
        digest = hashlib.sha512(json.dumps(group_version_document(members), sort_keys=True).encode()).hexdigest()
        paths[gv] = {'serverRelativeURL': f'/openapi/v3/{gv}?hash={digest.upper()[:128]}'}
    return {'paths': paths}


def v2_document(kinds: Iterable[Kind]) -> Obj:
    """Swagger 2.0, JSON: the same definitions (references rewritten to #/definitions)."""
    kinds = list(kinds)
    text = json.dumps({OBJECT_META: _META_SCHEMA, **{k.definition: _kind_schema(k) for k in kinds}})
    return {'swagger': '2.0', 'info': {'title': 'Kubernetes', 'version': VERSION['gitVersion']}, 'paths': {},
            'definitions': json.loads(text.replace('#/components/schemas/', '#/definitions/'))}
