"""Custom resources as kube-apiserver serves them: a CustomResourceDefinition (from a folder of YAML, or posted
to the API) declares its resource, and every write of that resource passes admission (admission.py) with
the CRD's schema: pruning, `fieldValidation` (Strict: 400; Warn: a `Warning` header), defaults, the schema
and the CEL rules (422 Invalid). A mixin of `KubeEmulator` (it needs `declare`, `seed` and `custom`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import kmock
import yaml

from e2e.local import admission
from e2e.local.kube_store import Call, Obj, _error

CRDS = kmock.resource('apiextensions.k8s.io/v1/customresourcedefinitions')
REPO_CRDS = Path(__file__).resolve().parents[2] / 'crds'  # the product's generated CRDs
# CRDs of other projects a cluster the operator works with has installed: the inference gateway's InferencePool
CLUSTER_CRDS = Path(__file__).resolve().parent / 'crds'


@dataclasses.dataclass(frozen=True)
class CustomResource:
    """What a served CRD version gives the API: its schema and printer columns."""

    group: str
    kind: str
    schema: Obj | None
    printer_columns: tuple[Obj, ...]


class CustomResources:
    custom: dict[kmock.resource, CustomResource]
    declare: Any
    seed: Any

    def register_crd(self, crd: Obj) -> None:
        """Serve every served version of a CustomResourceDefinition (what its create does on a real server)."""
        spec, names = crd['spec'], crd['spec']['names']
        for version in spec['versions']:
            if not version.get('served', True):
                continue
            resource = f'{spec["group"]}/{version["name"]}/{names["plural"]}'
            self.declare(resource, names['kind'], namespaced=spec.get('scope', 'Namespaced') == 'Namespaced',
                         subresources=tuple(version.get('subresources') or {}),
                         shortnames=tuple(names.get('shortNames') or ()), categories=tuple(names.get('categories') or ()))
            schema = (version.get('schema') or {}).get('openAPIV3Schema')
            self.custom[kmock.resource(resource)] = CustomResource(
                spec['group'], names['kind'], schema, tuple(version.get('additionalPrinterColumns') or ()))

    def register_crds(self, folder: str | Path = REPO_CRDS) -> None:
        """Register and store every CRD in a folder's YAML files (the repository's crds/ by default)."""
        for path in sorted(Path(folder).glob('*.yaml')):
            for doc in yaml.safe_load_all(path.read_text()):
                if isinstance(doc, dict) and doc.get('kind') == 'CustomResourceDefinition':
                    self.register_crd(doc)
                    with contextlib.suppress(ValueError):  # already stored
                        self.seed('customresourcedefinitions', doc)

    def _admit(self, request: Call, obj: Obj, old: Obj | None) -> Obj:
        if request.resource == CRDS and request.method == 'POST':
            self.register_crd(obj)
        custom = self.custom.get(request.resource)
        if custom is None or custom.schema is None:
            return obj
        unknown = admission.prune(custom.schema, obj)
        directive = request.params.get('fieldValidation', 'Ignore')
        if unknown and directive in ('Strict', 'Warn') and request.subresource != 'scale':
            if directive == 'Warn':
                request.warnings.extend(f'unknown field "{path}"' for path in unknown)
            else:
                fields = ', '.join(f'unknown field "{path}"' for path in unknown)
                raise _error(400, 'BadRequest', f'{custom.kind} in version "{request.resource.version}" cannot be '
                                                f'handled as a {custom.kind}: strict decoding error: {fields}')
        admission.default(custom.schema, obj)
        if errors := admission.validate(custom.schema, obj, old, request.subresource):
            body = admission.invalid_status(custom.kind, custom.group, obj['metadata']['name'], errors)
            raise kmock.KubernetesError(status=422, reason='Invalid', message=body['message'], details=body['details'])
        return obj
