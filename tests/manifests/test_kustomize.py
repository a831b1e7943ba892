"""manifests/overlays and components: each builds with kustomize (kubectl's), and every built-in kind in
the output validates against the Kubernetes schemas; the operator's probes and metrics Service line up."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / 'manifests'
CUSTOM = ('diffstage.io/', 'kopf.dev/', 'monitoring.coreos.com/', 'argoproj.io/')
needs_kubectl = pytest.mark.skipif(shutil.which('kubectl') is None,
                                   reason='kubectl is not installed (it ships kustomize)')


def build(path: Path) -> list[dict]:
    out = subprocess.run(['kubectl', 'kustomize', str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(docs: list[dict]) -> list[str]:
    import kubernetes_validate

    checked = []
    for doc in docs:
        if not doc['apiVersion'].startswith(CUSTOM):
            kubernetes_validate.validate(doc, '1.29', strict=True)
            checked.append(doc['kind'])
    return checked


def by_kind(docs: list[dict], kind: str) -> dict:
    return next(d for d in docs if d['kind'] == kind)


@needs_kubectl
def test_kind_overlay_never_pulls_the_operator_image():
    docs = build(MANIFESTS / 'overlays' / 'kind')
    container = by_kind(docs, 'Deployment')['spec']['template']['spec']['containers'][0]
    assert container['image'] == 'diffstage/operator:0.1.0' and container['imagePullPolicy'] == 'Never'
    assert 'Deployment' in validate(docs)


@needs_kubectl
def test_monitoring_overlay_adds_a_servicemonitor_for_the_metrics_service():
    docs = build(MANIFESTS / 'overlays' / 'monitoring')
    monitor, service = by_kind(docs, 'ServiceMonitor'), by_kind(docs, 'Service')
    assert monitor['spec']['selector']['matchLabels'].items() <= service['metadata']['labels'].items()
    assert monitor['spec']['endpoints'][0]['port'] == service['spec']['ports'][0]['name']
    assert 'Service' in validate(docs)


@needs_kubectl
def test_monitoring_overlay_scrapes_every_stage_pod_and_ships_the_dashboard():
    from stage_operator.builders.pod import build_pod
    from stage_operator.stage import parse_stage

    docs = build(MANIFESTS / 'overlays' / 'monitoring')
    monitor = by_kind(docs, 'PodMonitor')
    pod = build_pod(parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'u', 'generation': 1},
                                 'spec': {'model': {'builtin': 'tiny-sd'}}}), 0)
    assert monitor['spec']['selector']['matchLabels'].items() <= pod['metadata']['labels'].items()
    assert monitor['spec']['podMetricsEndpoints'][0]['port'] in {p['name'] for p in pod['spec']['containers'][0]['ports']}
    assert monitor['spec']['namespaceSelector'] == {'any': True}
    dashboard = next(d for d in docs if d['kind'] == 'ConfigMap' and d['metadata']['name'] == 'diffstage-grafana-dashboard')
    assert dashboard['metadata']['labels']['grafana_dashboard'] == '1'
    shipped = (MANIFESTS / 'components' / 'servicemonitor' / 'grafana-dashboard.json').read_text()
    assert dashboard['data'] == {'diffstage.json': shipped}
    assert by_kind(docs, 'ServiceMonitor')['spec']['endpoints'][0]['honorLabels'] is True


def test_probes_and_the_metrics_service_match_the_operator_command():
    docs = [d for d in yaml.safe_load_all((MANIFESTS / 'base' / 'operator.yaml').read_text()) if d]
    service = yaml.safe_load((MANIFESTS / 'base' / 'metrics-service.yaml').read_text())
    pod = by_kind(docs, 'Deployment')['spec']['template']
    container = pod['spec']['containers'][0]
    ports = {p['name']: p['containerPort'] for p in container['ports']}
    command = ' '.join(container['command'])
    assert f'--metrics-port {ports["metrics"]}' in command and f':{ports["health"]}/healthz' in command
    for probe in ('startupProbe', 'livenessProbe', 'readinessProbe'):
        assert container[probe]['httpGet'] == {'path': '/healthz', 'port': 'health'}, probe
    assert container['resources']['requests'] and container['resources']['limits']['memory']
    assert service['spec']['selector'].items() <= pod['metadata']['labels'].items()
    assert service['spec']['ports'][0]['targetPort'] == 'metrics'


def test_argocd_objects_validate():
    cm = yaml.safe_load((MANIFESTS / 'argocd' / 'argocd-cm.yaml').read_text())
    assert validate([cm]) == ['ConfigMap']
    apps = [d for d in yaml.safe_load_all((MANIFESTS / 'argocd' / 'application.yaml').read_text()) if d]
    assert [a['spec']['source']['path'] for a in apps] == ['manifests/base', 'manifests/samples']
    for app in apps:
        assert (ROOT / app['spec']['source']['path']).is_dir()
    stages = apps[1]['spec']
    assert stages['ignoreDifferences'] == [{'group': 'diffstage.io', 'kind': 'DiffusionStage',
                                            'jsonPointers': ['/spec/replicas']}]
    assert 'RespectIgnoreDifferences=true' in stages['syncPolicy']['syncOptions']
