"""crds/ is generated: it must equal the generator's output, and the CRD must carry what docs/crd.md documents."""
from __future__ import annotations

from pathlib import Path

import yaml

from stage_operator import crdgen
from stage_operator.api import meta

ROOT = Path(__file__).resolve().parents[2]


def test_crds_folder_matches_the_generator():
    for name, text in crdgen.render().items():
        path = ROOT / 'crds' / name
        assert path.exists(), f'{path} is missing: run `make crds`'
        assert path.read_text(encoding='utf-8') == text, f'{path} drifted from the generator: run `make crds`'


def test_check_mode_reports_drift(tmp_path, capsys):
    assert crdgen.main(['--out', str(tmp_path)]) == 0
    assert crdgen.main(['--out', str(tmp_path), '--check']) == 0
    (tmp_path / crdgen.CRD_FILE).write_text('edited by hand\n')
    assert crdgen.main(['--out', str(tmp_path), '--check']) == 1
    assert 'make crds' in capsys.readouterr().err


def test_crd_names_subresources_and_printer_columns():
    crd = yaml.safe_load((ROOT / 'crds' / crdgen.CRD_FILE).read_text())
    assert crd['metadata']['name'] == 'diffusionstages.diffstage.io'
    names = crd['spec']['names']
    assert (names['kind'], names['plural'], names['shortNames']) == ('DiffusionStage', 'diffusionstages', ['dstage'])
    version = crd['spec']['versions'][0]
    assert version['name'] == meta.VERSION and version['served'] and version['storage']
    assert version['subresources'] == {'status': {}, 'scale': {
        'specReplicasPath': '.spec.replicas', 'statusReplicasPath': '.status.replicas',
        'labelSelectorPath': '.status.selector'}}
    columns = [c['name'] for c in version['additionalPrinterColumns'] if not c.get('priority')]
    assert columns == ['Phase', 'Ready', 'Replicas', 'GPUs', 'Restarts', 'Age']
    wide = [c['name'] for c in version['additionalPrinterColumns']]  # -o wide: the reason beside the phase
    assert wide == ['Phase', 'Reason', 'Ready', 'Sleeping', 'Replicas', 'GPUs', 'Ranks', 'Queued', 'Jobs', 'Restarts', 'Age']


def test_every_printer_column_reads_a_field_of_the_schema():
    """A column whose path the schema lacks would print <none> forever (or the API server would prune it)."""
    version = crdgen.build_crd()['spec']['versions'][0]
    schema = version['schema']['openAPIV3Schema']
    for column in version['additionalPrinterColumns']:
        if column['jsonPath'].startswith('.metadata.'):
            continue
        node = schema
        for part in column['jsonPath'].lstrip('.').split('.'):
            assert part in node.get('properties', {}), f"{column['name']}: {column['jsonPath']} is not in the schema"
            node = node['properties'][part]
        assert node['type'] == column['type'], column


def _walk(node, path=''):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f'{path}/{key}')
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f'{path}[{i}]')


def test_schema_is_structural():
    """Every schema node has a type; no $ref, anyOf, nullable; additionalProperties never beside properties."""
    schema = crdgen.build_crd()['spec']['versions'][0]['schema']['openAPIV3Schema']
    for path, node in _walk(schema):
        if path.endswith('/properties') or path.endswith('/x-kubernetes-validations') or '/x-kubernetes-validations[' in path:
            continue
        if path.endswith('/default') or '/default/' in path or path.endswith('/enum') or path.endswith('/required'):
            continue
        assert not {'$ref', 'anyOf', 'oneOf', 'allOf', 'nullable', 'title', 'const'} & set(node), path
        assert 'type' in node, f'{path or "/"} has no type'
        assert not ('properties' in node and 'additionalProperties' in node), path


def test_schema_defaults_minimums_and_enums():
    spec = crdgen.build_crd()['spec']['versions'][0]['schema']['openAPIV3Schema']['properties']['spec']['properties']
    assert {k: v for k, v in spec['replicas'].items() if k != 'description'} == {
        'default': 1, 'minimum': 0, 'type': 'integer'}
    assert spec['parallel']['default'] == {} and spec['resources']['default'] == {}
    assert spec['parallel']['properties']['cfgParallelSize']['maximum'] == 2  # from stage_runtime.config
    assert spec['resources']['properties']['gpuResourceName']['default'] == 'nvidia.com/gpu'
    assert spec['engine']['properties']['executionMode']['enum'] == ['request', 'step']
    assert spec['autoscaling']['properties']['mode']['enum'] == ['None', 'External', 'Operator']
    assert 'default' not in spec['autoscaling']['properties']['minReplicas']  # or has() would always be true


# The API server refuses a root `metadata` schema with anything but name/generateName restrictions (a description
# too: "must not specify anything other than name and generateName") and publishes ObjectMeta's description there.
UNDESCRIBED = {'.metadata'}


def undescribed(schema, path=''):
    """Every schema node (property, list item `[]`, map value `{}`) without a description, as a dotted path."""
    missing = [path] if path and 'description' not in schema else []
    for name, sub in (schema.get('properties') or {}).items():
        missing += undescribed(sub, f'{path}.{name}')
    if 'items' in schema:
        missing += undescribed(schema['items'], f'{path}[]')
    if isinstance(schema.get('additionalProperties'), dict):
        missing += undescribed(schema['additionalProperties'], f'{path}{{}}')
    return missing


def test_every_field_has_a_description_for_kubectl_explain():
    schema = crdgen.build_crd()['spec']['versions'][0]['schema']['openAPIV3Schema']
    assert schema['properties']['metadata'] == {'type': 'object'}
    missing = [path for path in undescribed(schema) if path not in UNDESCRIBED]
    assert not missing, f'{len(missing)} schema nodes without a description (kubectl explain shows none): {missing}'
    empty = [path for path, node in _walk(schema) if isinstance(node.get('description'), str)
             and not node['description'].strip()]
    assert not empty, f'empty descriptions: {empty}'


def test_the_walk_names_an_undescribed_field_list_item_and_map_value():
    schema = {'type': 'object', 'properties': {
        'a': {'type': 'string'}, 'b': {'type': 'array', 'description': 'b', 'items': {'type': 'string'}},
        'c': {'type': 'object', 'description': 'c', 'additionalProperties': {'type': 'string'}},
        'd': {'type': 'object', 'description': 'd', 'properties': {'e': {'type': 'integer'}}}}}
    assert undescribed(schema) == ['.a', '.b[]', '.c{}', '.d.e']
