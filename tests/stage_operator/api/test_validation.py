"""Samples against the generated schema (jsonschema) and every CEL rule against valid and invalid objects."""
from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from support.crd_check import admit, apply_defaults, cel_messages, version_schema

from stage_operator import crdgen
from stage_operator.api.spec import StageSpec
from stage_runtime.config import ConfigError, ParallelConfig

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = sorted((ROOT / 'manifests' / 'samples').glob('*.yaml'))
CRD = crdgen.build_crd()
BASE = {'apiVersion': 'diffstage.io/v1alpha1', 'kind': 'DiffusionStage', 'metadata': {'name': 's'},
        'spec': {'model': {'builtin': 'tiny-sd'}}}


def stage(**spec) -> dict:
    obj = copy.deepcopy(BASE)
    obj['spec'].update(spec)
    return obj


def test_there_is_a_cpu_and_a_gpu_sample():
    docs = [yaml.safe_load(p.read_text()) for p in SAMPLES]
    names = {d['spec']['resources'].get('gpuResourceName', 'nvidia.com/gpu') for d in docs}
    assert '' in names and 'nvidia.com/gpu' in names, 'a CPU-rank sample and a GPU sample'


@pytest.mark.parametrize('path', SAMPLES, ids=lambda p: p.name)
def test_samples_are_admitted_and_parse(path):
    obj = yaml.safe_load(path.read_text())
    assert admit(CRD, obj) == []
    spec = StageSpec.model_validate(obj['spec'])  # extra="forbid": a typo the server would prune fails here
    assert spec.topology().world_size == spec.resources.gpus_per_pod


def test_tiny_cpu_sample_is_the_design_example():
    obj = yaml.safe_load((ROOT / 'manifests/samples/tiny-cpu.yaml').read_text())
    assert obj['metadata']['name'] == 'tiny'
    assert obj['spec'] == {'model': {'builtin': 'tiny-sd'}, 'replicas': 2, 'parallel': {'cfgParallelSize': 2},
                           'resources': {'gpusPerPod': 2, 'gpuResourceName': ''},
                           'engine': {'executionMode': 'step', 'maxNumSeqs': 4}}


def test_defaults_fill_nested_objects():
    spec = apply_defaults(version_schema(CRD), stage())['spec']
    assert spec['parallel']['cfgParallelSize'] == 1 and spec['resources']['gpusPerPod'] == 1
    assert spec['resources']['gpuResourceName'] == 'nvidia.com/gpu' and spec['replicas'] == 1
    assert spec['autoscaling'] == {'mode': 'None', 'drainTimeoutSeconds': 60}


URI = {'url': 'https://models.example/tiny.tar.gz', 'sha256': 'ab' * 32}
MODEL_CASES = [  # spec.model.source, .cache, .imageVolume (issue 18)
    ('source-pvc', {'model': {'source': {'pvc': {'claimName': 'models', 'subPath': 'sd/turbo'}}}}, []),
    ('source-image', {'model': {'source': {'image': {'reference': 'reg.example/sd:1'}}, 'imageVolume': 'never'}}, []),
    ('source-uri-cached', {'model': {'source': {'uri': URI}, 'cache': {'hostPath': '/var/cache/m', 'maxBytes': 10}}},
     []),
    ('two-sources', {'model': {'source': {'uri': URI, 'pvc': {'claimName': 'm'}}}},
     ['spec.model.source: model.source: set exactly one of pvc, image or uri']),
    ('no-source', {'model': {'source': {}}}, ['spec.model.source: model.source: set exactly one of pvc, image or uri']),
    ('source-and-path', {'model': {'path': '/m', 'source': {'uri': URI}}},
     ['spec.model: model: set exactly one of builtin, path or source']),
    ('bad-sha256', {'model': {'source': {'uri': {**URI, 'sha256': 'ABC123'}}}},
     ['spec.model.source.uri: model.source.uri.sha256 must be 64 lowercase hex digits (the SHA-256 of the '
      'archive), got "ABC123"']),
    ('bad-url', {'model': {'source': {'uri': {**URI, 'url': 's3://b/m.tgz'}}}},
     ['spec.model.source.uri: model.source.uri.url must be an http:// or https:// URL, got "s3://b/m.tgz"']),
    ('cache-without-uri', {'model': {'builtin': 'tiny-sd', 'cache': {'hostPath': '/c', 'maxBytes': 1}}},
     ['spec.model: model.cache applies to model.source.uri only (it stores downloads)']),
    ('cache-two-places', {'model': {'source': {'uri': URI}, 'cache': {'hostPath': '/c', 'pvc': {'claimName': 'c'},
                                                                       'maxBytes': 1}}},
     ['spec.model.cache: model.cache: set exactly one of hostPath or pvc']),
    ('pvc-subpath-escapes', {'model': {'source': {'pvc': {'claimName': 'm', 'subPath': 'a/../../etc'}}}},
     ['spec.model.source.pvc: model.source.pvc.subPath must be a relative path without .. (got a/../../etc)']),
]
COMPILE_CASES = [  # spec.compile (issue 44)
    ('compile-auto', {'compile': {'mode': 'auto'}}, []),
    ('compile-regional-on-a-node-folder', {'compile': {'mode': 'regional', 'shapes': ['1024x1024', '832x480x81'],
                                                       'maxGraphs': 8, 'timeoutSeconds': 600,
                                                       'cache': {'hostPath': '/var/cache/compiled'}}}, []),
    ('compile-full-on-a-claim', {'compile': {'mode': 'full', 'cache': {'pvc': {'claimName': 'compiled'}}}}, []),
    ('compile-shape-twice', {'compile': {'mode': 'regional', 'shapes': ['64x64', '32x32', '64x64']}},
     ['spec.compile: compile.shapes lists 64x64 twice: each shape is compiled once']),
    ('compile-cache-two-places', {'compile': {'mode': 'auto', 'cache': {'hostPath': '/c', 'pvc': {'claimName': 'c'}}}},
     ['spec.compile.cache: compile.cache: set exactly one of hostPath or pvc']),
    ('compile-cache-nowhere', {'compile': {'mode': 'auto', 'cache': {}}},
     ['spec.compile.cache: compile.cache: set exactly one of hostPath or pvc']),
]
QUANT_TP = ('spec: quantization.method fp8 with parallel.tensorParallelSize 2: tensor parallel cuts full-precision '
            'weights; quantized weights are not sharded (use Ulysses, ring or CFG parallel)')
QUANTIZATION_CASES = [  # spec.quantization (api/quantization.py; more in test_quantization.py)
    ('quantization-int8', {'quantization': {'method': 'int8-weight'}}, []),
    ('quantization-components-skip', {'quantization': {'method': 'fp8-storage', 'components': ['unet', 'vae'],
                                                       'skip': [r'\.ff\.', '^down_blocks']}}, []),
    ('quantization-gguf', {'quantization': {'method': 'gguf', 'file': 'flux1-dev-Q4_K.gguf'}}, []),
    ('quantization-with-ulysses', {'quantization': {'method': 'int8-weight'}, 'parallel': {'ulyssesDegree': 2},
                                   'resources': {'gpusPerPod': 2}}, []),
    ('quantization-none-with-tp', {'quantization': {}, 'parallel': {'tensorParallelSize': 2},
                                   'resources': {'gpusPerPod': 2}}, []),
    ('quantization-gguf-without-file', {'quantization': {'method': 'gguf'}},
     ['spec.quantization: quantization.method gguf needs file: the pre-quantized denoiser (.gguf), a path relative '
      'to the model folder or absolute']),
    ('quantization-file-without-gguf', {'quantization': {'method': 'int8-weight', 'file': 'd.gguf'}},
     ['spec.quantization: quantization.file (d.gguf) applies only to method gguf, not int8-weight']),
    ('quantization-gguf-components', {'quantization': {'method': 'gguf', 'file': 'd.gguf',
                                                       'components': ['transformer']}},
     ['spec.quantization: quantization.components (transformer) does not apply to method gguf: the GGUF file is '
      'the denoiser']),
    ('quantization-component-twice', {'quantization': {'method': 'fp8', 'components': ['unet', 'vae', 'unet']}},
     ['spec.quantization: quantization.components lists unet twice: each component is quantized once']),
    ('quantization-with-tp', {'quantization': {'method': 'fp8'}, 'parallel': {'tensorParallelSize': 2},
                              'resources': {'gpusPerPod': 2}}, [QUANT_TP]),
]
DP2 = {'parallel': {'dataParallelSize': 2}, 'resources': {'gpusPerPod': 2}}
DLO = {'offload': {'mode': 'distributed'}, **DP2}
DLO_WITH = 'spec: offload.mode distributed with '
OFFLOAD_CASES = [  # spec.offload (api/offload.py; more in test_offload.py)
    ('offload-layerwise', {'offload': {'mode': 'layerwise', 'residentLayers': 3, 'prefetch': False}}, []),
    ('offload-model-components', {'offload': {'mode': 'model', 'components': ['text_encoder', 'vae']}}, []),
    ('offload-dlo', DLO, []),
    ('offload-distributed-rank-local-dp1', {'offload': {'mode': 'distributed', 'allgather': False}}, []),
    ('offload-allgather-without-distributed', {'offload': {'mode': 'layerwise', 'allgather': False}},
     ['spec.offload: offload.allgather applies only to mode distributed, not layerwise']),
    ('offload-prefetch-with-model', {'offload': {'mode': 'model', 'prefetch': False}},
     ['spec.offload: offload.prefetch and offload.residentLayers apply only to modes layerwise and distributed, '
      'not model']),
    ('offload-dlo-dp1', {'offload': {'mode': 'distributed'}},
     [DLO_WITH + 'parallel.dataParallelSize 1: it shards the denoiser over the data-parallel ranks; set '
      'parallel.dataParallelSize > 1']),
    ('offload-dlo-with-ulysses', {'offload': {'mode': 'distributed'}, 'parallel': {'dataParallelSize': 2,
                                  'ulyssesDegree': 2}, 'resources': {'gpusPerPod': 4}},
     [DLO_WITH + 'model parallelism (tensor 1 x ulysses 2 x ring 1 x cfg 1 x pipeline 1): every rank must be a '
      'data-parallel replica (tensor, ulysses, ring, cfg and pipeline 1); use Ulysses or TP instead of DLO, or DLO '
      'alone']),
    ('offload-dlo-step-mode', {**DLO, 'engine': {'executionMode': 'step'}},
     [DLO_WITH + 'engine.executionMode step: a step-mode tick joins and ends requests per rank, out of the '
      'lock-step gathers; use request']),
    ('offload-dlo-block-cache', {**DLO, 'engine': {'cache': {'mode': 'block'}}},
     [DLO_WITH + 'engine.cache.mode block: a rank skipping blocks by its own cache decision would leave the others '
      'waiting in the gather']),
    ('offload-dlo-compile', {**DLO, 'compile': {'mode': 'regional'}},
     [DLO_WITH + "compile.mode regional: the gathers swap the weights of each block inside what a compiled graph runs"]),
    ('offload-dlo-quantized', {**DLO, 'quantization': {'method': 'int8-weight'}},
     [DLO_WITH + 'quantization.method int8-weight: the shards are plain weight storages, and a quantized weight is '
      'not one']),
]
AFTER_IDLE_RANGE = ('spec.sleep: sleep.afterIdle {} is out of range: more than 0s and at most 168h (a duration such '
                    'as 10m, 90s or 1h30m)')
SLEEP_CASES = [  # spec.sleep and spec.profiling (api/sleep.py; more in test_sleep.py)
    ('sleep-on-demand', {'sleep': {}}, []),
    ('sleep-after-idle', {'sleep': {'afterIdle': '1h30m', 'level': 2, 'drainTimeoutSeconds': 0,
                                    'wakeTimeoutSeconds': 600}}, []),
    ('sleep-after-a-week', {'sleep': {'afterIdle': '168h'}}, []),
    ('sleep-after-zero', {'sleep': {'afterIdle': '0s'}}, [AFTER_IDLE_RANGE.format('0s')]),
    ('sleep-after-too-long', {'sleep': {'afterIdle': '167h60m1s'}}, [AFTER_IDLE_RANGE.format('167h60m1s')]),
    ('profiling-default-volume', {'profiling': {}}, []),
    ('profiling-on-a-claim', {'profiling': {'maxSeconds': 30, 'recordShapes': True, 'profileMemory': True,
                                            'volume': {'pvc': {'claimName': 'traces'}}}}, []),
    ('profiling-empty-dir', {'profiling': {'volume': {'emptyDir': {'sizeLimit': '2Gi'}}}}, []),
    ('profiling-volume-two-places', {'profiling': {'volume': {'emptyDir': {}, 'pvc': {'claimName': 'p'}}}},
     ['spec.profiling.volume: profiling.volume: set exactly one of emptyDir or pvc']),
    ('profiling-volume-nowhere', {'profiling': {'volume': {}}},
     ['spec.profiling.volume: profiling.volume: set exactly one of emptyDir or pvc']),
]
SCALE_TO_ZERO = ('spec.autoscaling: autoscaling.minReplicas 0 is refused with mode Operator: a stage at 0 has no pod '
                 'to probe, so nothing would scale it back up; use mode External with KEDA (its HTTP add-on holds '
                 'requests and scales 0 to 1 through /scale), or set minReplicas >= 1')
OWNED_LABELS = ('spec.podTemplate: podTemplate.labels: diffstage.io/* and app.kubernetes.io/managed-by are labels of '
                'the operator (it selects and fences pods by them) and cannot be set')
OWNED_ANNOTATIONS = 'spec.podTemplate: podTemplate.annotations: diffstage.io/* are annotations of the operator and ' \
                    'cannot be set'
POD_TEMPLATE_CASES = [  # issue 17: the minReplicas-0 rule, the complete pod template, auth
    ('operator-min-zero', {'autoscaling': {'mode': 'Operator', 'minReplicas': 0, 'maxReplicas': 4}}, [SCALE_TO_ZERO]),
    ('external-scales-to-zero', {'autoscaling': {'mode': 'External'}, 'replicas': 0}, []),
    ('template-labels', {'podTemplate': {'labels': {'kueue.x-k8s.io/queue-name': 'q'}, 'annotations': {'a': 'b'},
                                         'schedulerName': 'volcano', 'runtimeClassName': 'nvidia'}}, []),
    ('template-serving-label', {'podTemplate': {'labels': {'diffstage.io/serving': 'true'}}}, [OWNED_LABELS]),
    ('template-managed-by', {'podTemplate': {'labels': {'app.kubernetes.io/managed-by': 'me'}}}, [OWNED_LABELS]),
    ('template-draining-annotation', {'podTemplate': {'annotations': {'diffstage.io/draining-since': 'x'}}},
     [OWNED_ANNOTATIONS]),
    ('auth', {'auth': {'secretRef': {'name': 'keys'}}, 'networkPolicy': {'enabled': False}}, []),
]
OPERATOR = {'mode': 'Operator', 'maxReplicas': 4}
JOBS_NEED_STORE = ('spec: autoscaling.metric jobs needs spec.jobs: it counts the video jobs queued and in progress in '
                   'the job store, and a stage without spec.jobs has no store')
METRIC_CASES = [  # autoscaling.metric cost and jobs (issue 47) and their targets
    ('cost-needs-a-target', {'autoscaling': {**OPERATOR, 'metric': 'cost'}},
     ['spec.autoscaling: autoscaling.metric cost needs targetCostPerReplica: the outstanding pixel-steps (remaining '
      'steps x pixels x frames x outputs) one replica should hold, e.g. 52428800 for one 1024x1024 50-step '
      'request']),
    ('cost-target-without-cost', {'autoscaling': {**OPERATOR, 'targetCostPerReplica': 1000}},
     ['spec.autoscaling: autoscaling.targetCostPerReplica applies only with metric cost']),
    ('cost-with-its-target', {'autoscaling': {**OPERATOR, 'metric': 'cost', 'targetCostPerReplica': 1000}}, []),
    ('jobs-needs-a-store', {'autoscaling': {**OPERATOR, 'metric': 'jobs'}}, [JOBS_NEED_STORE]),
    ('jobs-target-without-jobs', {'autoscaling': {**OPERATOR, 'targetJobsPerReplica': 2},
                                  'jobs': {'claimName': 'video-jobs'}},
     ['spec.autoscaling: autoscaling.targetJobsPerReplica applies only with metric jobs']),
    ('jobs-target-with-cost', {'autoscaling': {**OPERATOR, 'metric': 'cost', 'targetCostPerReplica': 1000,
                                               'targetJobsPerReplica': 2}},
     ['spec.autoscaling: autoscaling.targetJobsPerReplica applies only with metric jobs']),
    ('jobs-with-a-store', {'autoscaling': {**OPERATOR, 'metric': 'jobs'}, 'jobs': {'claimName': 'video-jobs'}}, []),
    ('jobs-with-its-target', {'autoscaling': {**OPERATOR, 'metric': 'jobs', 'targetJobsPerReplica': 2},
                              'jobs': {'claimName': 'video-jobs'}}, []),
    ('jobs-on-an-object-store', {'autoscaling': {**OPERATOR, 'metric': 'jobs'},
                                 'jobs': {'objectStore': {'bucket': 'video-jobs'}}}, []),
    ('jobs-claim-and-bucket', {'jobs': {'claimName': 'j', 'objectStore': {'bucket': 'video-jobs'}}},
     ['spec.jobs: jobs: set exactly one of claimName or objectStore']),
    ('jobs-presigned-claim', {'jobs': {'claimName': 'j', 'presignedContent': True}},
     ['spec.jobs: jobs.presignedContent needs jobs.objectStore: a claim has no URL to redirect to']),
]
CEL_CASES = [
    # (name, spec fields, exact messages)
    ('defaults', {}, []),
    ('cfg2-on-2', {'parallel': {'cfgParallelSize': 2}, 'resources': {'gpusPerPod': 2}}, []),
    ('product-mismatch', {'parallel': {'cfgParallelSize': 2, 'ulyssesDegree': 2}, 'resources': {'gpusPerPod': 2}},
     ['spec: parallel degrees multiply to 4 (tensor 1 x ulysses 2 x ring 1 x cfg 2 x data 1 x pipeline 1) '
      'but resources.gpusPerPod is 2']),
    ('gpus-without-degrees', {'resources': {'gpusPerPod': 8}},
     ['spec: parallel degrees multiply to 1 (tensor 1 x ulysses 1 x ring 1 x cfg 1 x data 1 x pipeline 1) '
      'but resources.gpusPerPod is 8']),
    ('model-both', {'model': {'builtin': 'tiny-sd', 'path': '/m'}},
     ['spec.model: model: set exactly one of builtin, path or source']),
    ('model-none', {'model': {'name': 'x'}}, ['spec.model: model: set exactly one of builtin, path or source']),
] + MODEL_CASES + COMPILE_CASES + QUANTIZATION_CASES + OFFLOAD_CASES + SLEEP_CASES + [
    ('operator-autoscaling', {'autoscaling': {'mode': 'Operator', 'minReplicas': 1, 'maxReplicas': 4}}, []),
    ('min-above-max', {'autoscaling': {'mode': 'Operator', 'minReplicas': 5, 'maxReplicas': 4}},
     ['spec.autoscaling: autoscaling.minReplicas (5) must not exceed maxReplicas (4)']),
    ('operator-needs-max', {'autoscaling': {'mode': 'Operator'}},
     ['spec.autoscaling: autoscaling.mode Operator needs maxReplicas']),
    ('fields-without-operator-mode', {'autoscaling': {'mode': 'External', 'maxReplicas': 4}},
     ['spec.autoscaling: autoscaling.mode is External: minReplicas, maxReplicas, metric, targetInFlightPerReplica, '
      'targetCostPerReplica, targetJobsPerReplica, scaleUpStabilizationSeconds, scaleDownStabilizationSeconds apply '
      'only with mode Operator']),
    ('fields-with-mode-none', {'autoscaling': {'targetInFlightPerReplica': 2}},
     ['spec.autoscaling: autoscaling.mode is None: minReplicas, maxReplicas, metric, targetInFlightPerReplica, '
      'targetCostPerReplica, targetJobsPerReplica, scaleUpStabilizationSeconds, scaleDownStabilizationSeconds apply '
      'only with mode Operator']),
] + METRIC_CASES + [
    ('drain-timeout-any-mode', {'autoscaling': {'drainTimeoutSeconds': 5}}, []),
    ('backoff-inverted', {'restartPolicy': {'backoffInitialSeconds': 60, 'backoffMaxSeconds': 30}},
     ['spec.restartPolicy: restartPolicy.backoffInitialSeconds (60) must not exceed backoffMaxSeconds (30)']),
    ('stall-inverted', {'engine': {'limits': {'stallUnreadySeconds': 300, 'stallFailSeconds': 300}}},
     ['spec.engine.limits: engine.limits.stallFailSeconds (300) must be longer than stallUnreadySeconds (300)']),
    ('engine-cache-policy-limits', {'engine': {'schedulingPolicy': 'priority', 'cache': {'mode': 'block'},
                                               'limits': {'maxRequestCost': 10**9, 'stallUnreadySeconds': 30}}}, []),
    ('abort-ids', {'abort': {'id': 'a1', 'requestIds': ['r1']}}, []),
    ('abort-all', {'abort': {'id': 'a1', 'all': True}}, []),
    ('abort-neither', {'abort': {'id': 'a1'}}, ['spec.abort: abort: set exactly one of requestIds or all: true']),
    ('abort-both', {'abort': {'id': 'a1', 'all': True, 'requestIds': ['r']}},
     ['spec.abort: abort: set exactly one of requestIds or all: true']),
    ('rollout-surge', {'rollout': {'maxSurge': 1, 'maxUnavailable': 0, 'progressDeadlineSeconds': 120}}, []),
    ('rollout-stuck', {'rollout': {'maxSurge': 0, 'maxUnavailable': 0}},
     ['spec.rollout: rollout: maxSurge (0) and maxUnavailable (0) cannot both be 0: the rollout could never '
      'replace a pod']),
    ('disruption', {'disruption': {'maxUnavailable': 0}}, []),
] + POD_TEMPLATE_CASES


@pytest.mark.parametrize('spec, messages', [c[1:] for c in CEL_CASES], ids=[c[0] for c in CEL_CASES])
def test_cel_rules(spec, messages):
    assert admit(CRD, stage(**spec)) == messages


def test_every_cel_rule_is_exercised_by_a_failing_case():
    rules = set()
    for path, node in _nodes(version_schema(CRD)):
        rules.update(r['messageExpression'] for r in node.get('x-kubernetes-validations', ()))
    failing = {m.split(': ', 1)[1] for _, spec, msgs in CEL_CASES for m in msgs}
    assert len(rules) == 41 and len(failing) >= len(rules) - 1  # the autoscaling mode message varies by mode


def _nodes(node, path=''):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.get('properties', {}).items():
            yield from _nodes(value, f'{path}.{key}')


@pytest.mark.parametrize('field, value', [('replicas', -1), ('engine', {'executionMode': 'turbo'}),
                                          ('parallel', {'cfgParallelSize': 3}), ('parallel', {'tensorParallelSize': 0})])
def test_schema_rejects_out_of_range_values(field, value):
    assert admit(CRD, stage(**{field: value})), f'{field}={value!r} must be rejected'


DEGREES = [1, 2]


@pytest.mark.parametrize('tp, uly, ring, cfg, dp, gpus', [
    (*degrees, gpus) for degrees in itertools.product(DEGREES, DEGREES, DEGREES, DEGREES, DEGREES) for gpus in (1, 4, 8)
    if degrees[3] <= 2][::3])
def test_cel_product_rule_agrees_with_the_runtime_topology(tp, uly, ring, cfg, dp, gpus):
    """The CEL arithmetic and stage_runtime.config.ParallelConfig (the source of truth) accept the same specs."""
    parallel = {'tensorParallelSize': tp, 'ulyssesDegree': uly, 'ringDegree': ring, 'cfgParallelSize': cfg,
                'dataParallelSize': dp}
    cel_ok = cel_messages(version_schema(CRD), stage(parallel=parallel, resources={'gpusPerPod': gpus})) == []
    try:
        ParallelConfig(tensor_parallel_size=tp, ulysses_degree=uly, ring_degree=ring, cfg_parallel_size=cfg,
                       data_parallel_size=dp, num_gpus=gpus)
        runtime_ok = True
    except ValueError:
        runtime_ok = False
    assert cel_ok == runtime_ok
    if not runtime_ok:
        with pytest.raises(ValidationError, match='parallel topology does not fit resources.gpusPerPod'):
            StageSpec.model_validate(stage(parallel=parallel, resources={'gpusPerPod': gpus})['spec'])


def test_spec_errors_name_field_and_value():
    with pytest.raises(ValidationError) as info:
        StageSpec.model_validate({'model': {'builtin': 'tiny-sd'}, 'replicas': -1, 'engin': {}})
    text = str(info.value)
    assert 'replicas' in text and '-1' in text and 'engin' in text
    with pytest.raises(ConfigError, match=r'num_gpus=3 is not divisible'):
        StageSpec.model_construct(parallel=StageSpec.model_fields['parallel'].default_factory().model_copy(
            update={'cfg_parallel_size': 2}), resources=StageSpec.model_fields['resources'].default_factory().model_copy(
            update={'gpus_per_pod': 3})).topology()


MODEL_RULE_CASES = MODEL_CASES + COMPILE_CASES + QUANTIZATION_CASES + OFFLOAD_CASES + SLEEP_CASES + METRIC_CASES


@pytest.mark.parametrize('spec, messages', [c[1:] for c in MODEL_RULE_CASES], ids=[c[0] for c in MODEL_RULE_CASES])
def test_the_operator_refuses_what_the_api_server_refuses_with_the_same_words(spec, messages):
    """The pydantic side of each model rule (a server without CEL, or an object written before the CRD)."""
    body = stage(**spec)['spec']
    if not messages:
        StageSpec.model_validate(body)
        return
    with pytest.raises(ValidationError) as info:
        StageSpec.model_validate(body)
    assert messages[0].split(': ', 1)[1] in str(info.value)


@pytest.mark.parametrize('field, value', [('startupTimeoutSeconds', 0), ('startupTimeoutSeconds', 'ten'),
                                          ('model', {'source': {'uri': {'url': 'https://x/m.tgz'}}}),
                                          ('model', {'source': {'image': {'reference': 'r', 'path': 'rel'}}}),
                                          ('model', {'source': {'uri': URI}, 'cache': {'hostPath': '/c'}}),
                                          ('model', {'source': {'image': {'reference': 'r'}}, 'imageVolume': 'yes'})])
def test_schema_rejects_bad_model_delivery_fields(field, value):
    assert admit(CRD, stage(**{field: value})), f'{field}={value!r} must be rejected'


def test_startup_timeout_defaults_to_ten_minutes():
    assert apply_defaults(version_schema(CRD), stage())['spec']['startupTimeoutSeconds'] == 600


@pytest.mark.parametrize('spec, messages', [c[1:] for c in POD_TEMPLATE_CASES], ids=[c[0] for c in POD_TEMPLATE_CASES])
def test_the_operator_refuses_the_pod_template_and_scale_to_zero_cases_too(spec, messages):
    body = stage(**spec)['spec']
    if not messages:
        StageSpec.model_validate(body)
        return
    with pytest.raises(ValidationError) as info:
        StageSpec.model_validate(body)
    key = 'minReplicas 0' if 'minReplicas' in messages[0] else 'belong to the operator'
    assert key in str(info.value)


@pytest.mark.parametrize('spec', [{'auth': {'secretRef': {}}}, {'auth': {}}, {'auth': {'secretRef': {'name': ''}}},
                                  {'networkPolicy': {'enabled': 'sometimes'}}, {'podTemplate': {'schedulerName': ''}}])
def test_schema_rejects_bad_auth_and_network_fields(spec):
    assert admit(CRD, stage(**spec)), f'{spec!r} must be rejected'


def test_the_crd_says_which_pod_fields_the_operator_owns():
    template = version_schema(CRD)['properties']['spec']['properties']['podTemplate']
    words = ' '.join(template['description'].split())
    assert "The operator's own fields cannot be overridden" in words
    assert all(owned in words for owned in ('diffstage.io/*', 'command', 'probes', 'GPU limits', 'restart policy'))
