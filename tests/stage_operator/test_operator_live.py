"""Abort through the CR and operator autoscaling against live stages: the real operator (kopf, in a thread),
the emulated API, two real `stage-runtime serve` processes as pod containers at their own pod IPs (started
once for the module), the test as kubelet."""
from __future__ import annotations

import time

import httpx
import pytest
from support.live_pods import Generation, events, live_stages, map_pod, replica, wait_in_flight, watch_until
from support.operator_harness import STAGES_PATH, Cluster, manifest, operator, settle, wait_for

ONE_RANK = {'parallel': {}, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''},
            'engine': {'executionMode': 'step', 'maxNumSeqs': 4},
            'healthCheck': {'periodSeconds': 0.25, 'timeoutSeconds': 1, 'failureThreshold': 3}}


@pytest.fixture(scope='module')
def live(tiny_sd_path, tmp_path_factory):
    """Two live stages (A, B) for the module, one CPU rank each; each test leaves them idle."""
    with live_stages(tiny_sd_path, tmp_path_factory.mktemp('live-stages'), 2) as stages:
        yield stages


@pytest.fixture
def cluster(kube_emulator, kubeconfig, live):
    c = Cluster(kube_emulator)
    yield c
    c.close()
    for s in live:
        with httpx.Client(base_url=s.http_url, timeout=10) as client:
            leftover = client.get('/v1/requests').json()['requests']
            if leftover:  # a failed test: leave the shared stage idle for the next one
                client.post('/v1/abort', json={'all': True})
            assert not leftover, f'requests still in flight after the test: {leftover}'


def test_abort_through_the_spec_reaches_every_serving_pod_once(cluster, kube_emulator, live):
    a, _ = live
    with operator(kube_emulator):
        cluster.apply(manifest('ab', replicas=1, **ONE_RANK))
        wait_for(lambda: 'ab-0' in cluster.pods('ab'), what='the pod')
        map_pod(cluster, 'ab-0', a.http_url)
        wait_for(lambda: replica(cluster, 'ab', 0).get('health') == 'Healthy', what='probed')
        calls = [Generation(a.http_url, f'long-{i}', 600) for i in range(2)]
        wait_in_flight(a.http_url, 2, calls)
        cluster.patch_spec('ab', {'abort': {'id': 'abort-1', 'requestIds': ['long-0', 'long-1', 'gone']}})
        for call in calls:
            call.join(30)
            assert call.status == 409 and call.body['error']['type'] == 'request_aborted', (call.status, call.body)
        result = wait_for(lambda: cluster.status('ab').get('abort'), what='status.abort')
        assert result['observedId'] == 'abort-1'
        assert sorted(result['aborted']) == ['long-0', 'long-1'] and result['notFound'] == ['gone']
        assert result['unreachable'] == [] and result['completedTime']
        wait_for(lambda: events(kube_emulator, 'ab', 'Aborted'), what='the Aborted Event')  # after the status write
        aborted = httpx.get(f'{a.http_url}/v1/stats', timeout=5).json()['aborted_total']
        cluster.patch_spec('ab', {'healthCheck': {'timeoutSeconds': 2}})  # another change: the same id is not resent
        wait_for(lambda: cluster.status('ab').get('observedGeneration') == 3, what='the spec change observed')
        settle()  # two more reconciles of the new generation: the same abort id is not sent again
        assert httpx.get(f'{a.http_url}/v1/stats', timeout=5).json()['aborted_total'] == aborted
        assert len(events(kube_emulator, 'ab', 'Aborted')) == 1


def test_operator_autoscaling_scales_up_then_drains_before_removing(cluster, kube_emulator, live):
    a, b = live
    policy = {'mode': 'Operator', 'minReplicas': 1, 'maxReplicas': 2, 'targetInFlightPerReplica': 3,
              'scaleUpStabilizationSeconds': 1, 'scaleDownStabilizationSeconds': 2, 'drainTimeoutSeconds': 120}
    from prometheus_client import REGISTRY
    decisions = {d: REGISTRY.get_sample_value('diffstage_operator_autoscaling_decisions_total', {'direction': d}) or 0
                 for d in ('ScaledUp', 'ScaledDown')}
    with operator(kube_emulator):
        cluster.apply(manifest('as', replicas=1, autoscaling=policy, **ONE_RANK))
        wait_for(lambda: 'as-0' in cluster.pods('as'), what='the first pod')
        map_pod(cluster, 'as-0', a.http_url)
        wait_for(lambda: replica(cluster, 'as', 0).get('health') == 'Healthy', what='probed')
        assert cluster.status('as')['autoscaling']['desiredReplicas'] == 1

        # Load past the target (4 in flight > 3 per replica): a second replica after the up window.
        loaded_at = time.monotonic()
        first = [Generation(a.http_url, f'up-{i}', 60) for i in range(4)]
        wait_in_flight(a.http_url, 4, first)
        up_at = watch_until(lambda: 'as-1' in cluster.pods('as'), 30, 'a second replica')
        assert up_at - loaded_at >= 1.0, 'scaled up before the up window had passed'
        scaled = wait_for(lambda: cluster.status('as')['autoscaling']['desiredReplicas'] == 2
                          and cluster.status('as')['autoscaling'], what='desired 2 in status')  # pods go first
        assert scaled['desiredReplicas'] == 2 and 'scale up to 2' in scaled['reason'] and scaled['lastScaleTime']
        map_pod(cluster, 'as-1', b.http_url)

        # Less load: A keeps 2 in flight, B gets 1 (the least loaded: chosen for removal while it works).
        on_b = Generation(b.http_url, 'on-b', 400)
        second = [Generation(a.http_url, f'keep-{i}', 150) for i in range(2)]
        wait_in_flight(b.http_url, 1, [on_b])
        for call in first:
            call.join(120)
            assert call.status == 200, call.body
        quiet_at = max(call.done_at for call in first)
        fenced_at = watch_until(lambda: cluster.pods('as')['as-1']['metadata']['labels']['diffstage.io/serving']
                                == 'false', 60, 'as-1 fenced')
        assert fenced_at - quiet_at >= 1.5, 'scaled down before the down window had passed'
        assert on_b.is_alive(), 'the request on the removed replica is still running when it is fenced'
        wait_for(lambda: cluster.status('as')['autoscaling']['desiredReplicas'] == 1, what='desired 1 in status')
        assert 'as-1' in cluster.pods('as') and on_b.status is None, 'still there while its request runs'
        assert 'draining-since' in str(cluster.pods('as')['as-1']['metadata']['annotations'])
        deleted_at = watch_until(lambda: 'as-1' not in cluster.pods('as'), 120, 'as-1 deleted once idle')
        assert on_b.status == 200 and on_b.body['data'][0]['b64_json'], on_b.body
        assert on_b.done_at < deleted_at, 'the pod was deleted before its request finished'
        for call in second:
            call.join(120)
            assert call.status == 200, call.body
        assert [e['reason'] for e in events(kube_emulator, 'as') if e['reason'] in ('ScaledUp', 'ScaledDown')] \
            == ['ScaledUp', 'ScaledDown']
        assert events(kube_emulator, 'as', 'DrainingReplica')
    for direction, before in decisions.items():
        assert REGISTRY.get_sample_value('diffstage_operator_autoscaling_decisions_total',
                                         {'direction': direction}) == before + 1
    stage_writes = [r for r in kube_emulator._requests if r.resource is not None
                    and r.resource.plural == 'diffusionstages' and r.method.value in ('PATCH', 'PUT')
                    and r.subresource != 'status' and not r.headers.get('User-Agent', '').startswith('python-httpx')]
    assert stage_writes, 'kopf adds its finalizer with a patch'
    touched = [r.data for r in stage_writes if r.subresource == 'scale' or 'spec' in (r.data or {})]
    assert touched == [], f'the operator never writes spec (nor /scale): {touched}'


def test_external_autoscaling_drives_replicas_through_the_scale_subresource(cluster, kube_emulator):
    with operator(kube_emulator):
        cluster.apply(manifest('ex', replicas=1, autoscaling={'mode': 'External'}, **ONE_RANK))
        wait_for(lambda: cluster.status('ex').get('replicas') == 1, what='one replica')
        scale = cluster.http.get(f'{STAGES_PATH}/ex/scale').json()
        assert scale['status'] == {'replicas': 1, 'selector': 'diffstage.io/stage=ex'}, 'HPA needs the selector'
        cluster.scale('ex', 3)  # what an HPA or KEDA does
        wait_for(lambda: set(cluster.pods('ex')) == {'ex-0', 'ex-1', 'ex-2'}, what='three pods')
        wait_for(lambda: cluster.http.get(f'{STAGES_PATH}/ex/scale').json()['status']['replicas'] == 3,
                 what='/scale reports 3')
        assert 'autoscaling' not in cluster.status('ex')
