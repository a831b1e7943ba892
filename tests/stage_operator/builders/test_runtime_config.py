"""spec.loras → the stage's startup adapters (stage.yaml), never rolled (applied live), accepted by the runtime."""

from __future__ import annotations

import copy

import pytest
import yaml

from stage_operator.builders.children import build_configmap
from stage_operator.builders.pod import template_hash
from stage_operator.stage import parse_stage
from stage_runtime.config import load_config

BASE = {'model': {'builtin': 'tiny-sd'}, 'replicas': 1, 'resources': {'gpusPerPod': 1, 'gpuResourceName': ''}}
LORAS = [{'name': 'pixel-art', 'path': '/adapters/pixel'}, {'name': 'ink', 'path': '/adapters/ink.safetensors',
                                                            'pinned': False}]


def stage(**spec):
    st = parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'uid-9', 'generation': 3},
                      'spec': {**copy.deepcopy(BASE), **spec}})
    assert st.spec is not None, st.error
    return st


def test_spec_loras_become_the_stage_startup_adapters():
    config = load_config(yaml.safe_load(build_configmap(stage(loras=LORAS, maxLoras=4))['data']['stage.yaml']))
    assert [(s.name, s.path, s.pinned) for s in config.loras] == [('pixel-art', '/adapters/pixel', True),
                                                                   ('ink', '/adapters/ink.safetensors', False)]
    assert config.max_loras == 4
    assert load_config(yaml.safe_load(build_configmap(stage())['data']['stage.yaml'])).loras == ()


def test_changing_the_list_never_rolls_the_pods_it_is_applied_live():
    """The template hash leaves spec.loras out (lora_sync loads a change on the running replicas); what new
    replicas start with is the ConfigMap's list, the one applied everywhere."""
    assert len({template_hash(stage(**spec)) for spec in ({}, {'loras': LORAS}, {'loras': LORAS[:1]})}) == 1
    assert template_hash(stage(maxLoras=4)) != template_hash(stage())               # a startup setting: rolls
    applied = [{'name': 'old', 'path': '/adapters/old', 'pinned': True}]
    config = load_config(yaml.safe_load(build_configmap(stage(loras=LORAS), applied)['data']['stage.yaml']))
    assert [(s.name, s.path) for s in config.loras] == [('old', '/adapters/old')]


@pytest.mark.parametrize('lora, field', [({'name': '../x', 'path': '/a'}, 'name'), ({'name': 'a', 'path': ''}, 'path')])
def test_bad_adapters_are_refused_naming_the_field(lora, field):
    st = parse_stage({'metadata': {'name': 'tiny', 'namespace': 'team', 'uid': 'u', 'generation': 1},
                      'spec': {**copy.deepcopy(BASE), 'loras': [lora]}})
    assert st.spec is None and f'loras.0.{field}' in st.error


def test_engine_cache_scheduling_policy_and_limits_become_the_stage_config_without_extra_args():
    engine = {'schedulingPolicy': 'priority', 'cache': {'mode': 'block', 'threshold': 0.2, 'finalSteps': 2},
              'limits': {'maxRequestCost': 5_000_000, 'stallUnreadySeconds': 30, 'stallFailSeconds': 90}}
    config = load_config(yaml.safe_load(build_configmap(stage(engine=engine))['data']['stage.yaml']))
    assert config.scheduler.scheduling_policy == 'priority'
    assert (config.cache.mode, config.cache.threshold, config.cache.warmup_steps, config.cache.final_steps) == \
        ('block', 0.2, 1, 2)
    assert (config.limits.max_request_cost, config.limits.stall_unready_s, config.limits.stall_fail_s) == \
        (5_000_000, 30.0, 90.0)
    defaults = load_config(yaml.safe_load(build_configmap(stage())['data']['stage.yaml']))
    assert (defaults.scheduler.scheduling_policy, defaults.cache.mode, defaults.limits) == \
        ('fcfs', 'none', load_config({'model': {'path': '/m'}}).limits)      # the runtime's own defaults


def test_spec_jobs_becomes_the_stage_jobs_config_on_the_claims_mount():
    jobs = {'claimName': 'video-jobs', 'checkpointEverySteps': 3, 'retentionSeconds': 7200, 'leaseSeconds': 12}
    config = load_config(yaml.safe_load(build_configmap(stage(jobs=jobs))['data']['stage.yaml']))
    assert (config.jobs.store, config.jobs.checkpoint_every_steps, config.jobs.retention_s, config.jobs.lease_s) == \
        ('/var/lib/diffstage/jobs', 3, 7200.0, 12.0)
    assert load_config(yaml.safe_load(build_configmap(stage())['data']['stage.yaml'])).jobs.store is None
    assert 'jobs' not in yaml.safe_load(build_configmap(stage())['data']['stage.yaml']), 'unchanged without jobs'
    assert template_hash(stage(jobs=jobs)) != template_hash(stage())
    assert template_hash(stage(jobs={**jobs, 'leaseSeconds': 13})) != template_hash(stage(jobs=jobs)), 'rolls'


def test_an_object_store_becomes_the_stage_jobs_config_on_its_bucket():
    jobs = {'objectStore': {'bucket': 'video-jobs', 'prefix': 'stages/a', 'endpoint': 'http://minio:9000',
                            'region': 'eu-west-1'}, 'presignedContent': True}
    config = load_config(yaml.safe_load(build_configmap(stage(jobs=jobs))['data']['stage.yaml']))
    assert (config.jobs.store, config.jobs.endpoint, config.jobs.region, config.jobs.presigned_content) == (
        's3://video-jobs/stages/a', 'http://minio:9000', 'eu-west-1', True)


def test_spec_playground_false_turns_the_page_off_and_unset_changes_nothing():
    from stage_operator.builders.runtime_config import serve_command
    from stage_runtime.cli import build_parser

    off = stage(playground=False)
    assert '--no-playground' in serve_command(off.spec, 'tiny')
    assert '--no-playground' not in serve_command(stage(playground=True).spec, 'tiny')
    assert '--no-playground' not in serve_command(stage().spec, 'tiny')
    assert template_hash(stage()) == template_hash(stage(playground=None)), 'unchanged for stages without it'
    assert template_hash(off) != template_hash(stage()), 'turning it off rolls the pods'
    argv = serve_command(off.spec, 'tiny')[1:]        # the runtime's own parser takes what the operator passes
    assert build_parser().parse_args(argv).playground is False
