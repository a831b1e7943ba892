"""The operator's ClusterRole in manifests/base/rbac.yaml, as a question: is (group, resource, verb) granted?"""
from __future__ import annotations

from pathlib import Path

import yaml

RBAC = Path(__file__).resolve().parents[2] / 'manifests' / 'base' / 'rbac.yaml'


def rbac_rules() -> list[dict]:
    role = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d and d['kind'] == 'ClusterRole'
                and d['metadata']['name'] == 'diffstage-operator')
    return role['rules']


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(group in r['apiGroups'] and resource in r['resources'] and verb in r['verbs'] for r in rbac_rules())
