"""manifests/: kustomize builds base/; RBAC grants what the operator does and nothing it doesn't need."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.rbac import allowed, rbac_rules

from stage_operator.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / 'manifests' / 'base'


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.skipif(shutil.which('kubectl') is None, reason='kubectl is not installed (it ships kustomize)')
def test_kustomize_builds_the_base():
    out = subprocess.run(['kubectl', 'kustomize', str(BASE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = sorted(d['kind'] for d in docs)
    assert kinds == ['ClusterKopfPeering', 'ClusterRole', 'ClusterRole', 'ClusterRoleBinding', 'CustomResourceDefinition',
                     'CustomResourceDefinition', 'Deployment', 'Namespace', 'Service', 'ServiceAccount']
    crd = next(d for d in docs if d['kind'] == 'CustomResourceDefinition' and d['spec']['group'] == 'diffstage.io')
    generated = yaml.safe_load((ROOT / 'crds' / 'diffusionstage.yaml').read_text())
    assert crd['spec'] == generated['spec'], 'the base ships the generated CRD'
    peering = next(d for d in docs if d['kind'] == 'ClusterKopfPeering')
    assert 'namespace' not in peering['metadata'], 'cluster-scoped'


def test_rbac_is_least_privilege():
    rules = rbac_rules()
    for rule in rules:
        assert '*' not in rule['verbs'] + rule['resources'] + rule['apiGroups'], rule
        assert 'deletecollection' not in rule['verbs'], rule
        if 'update' in rule['verbs']:  # only what OwnerReferencesPermissionEnforcement asks for blockOwnerDeletion
            assert rule['resources'] == ['diffusionstages/finalizers'] and rule['verbs'] == ['update'], rule
    assert not any('secrets' in r['resources'] for r in rules), 'no Secret cluster-wide: see the auth role'
    assert allowed('networking.k8s.io', 'networkpolicies', 'create') and allowed('', 'services', 'get')
    assert not allowed('diffstage.io', 'diffusionstages', 'create'), 'the operator never creates or deletes stages'
    assert allowed('', 'pods', 'patch'), 'fencing relabels a pod out of the Service'
    assert not allowed('', 'pods/status', 'patch') and not allowed('', 'pods/exec', 'create'), 'the kubelet\'s'


def test_deployment_runs_the_operator_cluster_wide_with_peering():
    deployment = next(d for d in load_all(BASE / 'operator.yaml') if d['kind'] == 'Deployment')
    pod = deployment['spec']['template']['spec']
    command = pod['containers'][0]['command']
    assert command[:3] == ['python', '-m', 'stage_operator']
    args = build_parser().parse_args(command[3:])
    assert args.all_namespaces and args.peering == 'diffstage' and not args.standalone
    assert pod['serviceAccountName'] == 'diffstage-operator'
    assert deployment['spec']['strategy']['type'] == 'Recreate'
    peering = next(d for d in load_all(BASE / 'kopf-peering.yaml') if d['kind'] == 'ClusterKopfPeering')
    assert peering['metadata']['name'] == args.peering


KUBERNETES = ['1.29', '1.37']  # CEL messageExpression is GA from 1.29


@pytest.mark.parametrize('version', KUBERNETES)
def test_base_and_crd_validate_against_the_kubernetes_schemas(version):
    import kubernetes_validate

    docs = [d for name in ('namespace.yaml', 'rbac.yaml', 'operator.yaml', 'kopf-peering.yaml', 'metrics-service.yaml')
            for d in load_all(BASE / name)] + load_all(ROOT / 'crds' / 'diffusionstage.yaml')
    checked = [d['kind'] for d in docs if d['apiVersion'] != 'kopf.dev/v1']
    for doc in docs:
        if doc['apiVersion'] != 'kopf.dev/v1':  # the peering object's own CRD is in the list
            kubernetes_validate.validate(doc, version, strict=True)
    assert checked.count('CustomResourceDefinition') == 2 and 'Deployment' in checked


def test_the_auth_role_reads_secrets_by_name_only_and_is_not_bound_cluster_wide():
    """spec.auth.secretRef: `get` on secrets (no list/watch: no enumeration), a ClusterRole the platform binds
    per namespace with a RoleBinding; no ClusterRoleBinding grants it."""
    docs = load_all(BASE / 'rbac.yaml')
    role = next(d for d in docs if d['kind'] == 'ClusterRole' and d['metadata']['name'] == 'diffstage-operator-stage-auth')
    assert role['rules'] == [{'apiGroups': [''], 'resources': ['secrets'], 'verbs': ['get']}]
    bindings = [d for d in docs if d['kind'] == 'ClusterRoleBinding']
    assert bindings and all(b['roleRef']['name'] == 'diffstage-operator' for b in bindings)
