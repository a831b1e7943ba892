"""resolve_units over the real tiny pipelines: one unit per component (model mode), denoiser head + blocks in
execution order (layerwise), every managed weight in exactly one unit, storages adopted without changing
the Parameter objects, and unknown components named in a ConfigError."""

from __future__ import annotations

import pytest
from diffusers import DiffusionPipeline

from offload_probes import bitwise_equal, snapshot
from stage_runtime.errors import ConfigError
from stage_runtime.offload.plan import denoiser_blocks, resolve_units


@pytest.fixture(scope="module")
def sd_pipe(tiny_sd_path):
    return DiffusionPipeline.from_pretrained(tiny_sd_path, local_files_only=True, low_cpu_mem_usage=False)


@pytest.fixture(scope="module")
def dit_pipe(tiny_dit_path):
    return DiffusionPipeline.from_pretrained(tiny_dit_path, local_files_only=True, low_cpu_mem_usage=False)


def test_model_mode_one_unit_per_module_component(sd_pipe):
    units = resolve_units(sd_pipe, sd_pipe.unet, "model", ())
    assert sorted(u.name for u in units) == ["text_encoder", "unet", "vae"]
    assert all(u.kind == "component" and u.nbytes > 0 for u in units)
    only = resolve_units(sd_pipe, sd_pipe.unet, "model", ("vae",))
    assert [u.name for u in only] == ["vae"]


def test_layerwise_splits_the_denoiser_in_execution_order(sd_pipe, dit_pipe):
    units = resolve_units(sd_pipe, sd_pipe.unet, "layerwise", ("unet",))
    assert [u.name for u in units] == ["unet.head"] + [f"unet.block{i}" for i in range(5)]   # down 2, mid, up 2
    blocks = denoiser_blocks(sd_pipe.unet)
    assert blocks[2] is sd_pipe.unet.mid_block and blocks[0] is sd_pipe.unet.down_blocks[0]
    dit = resolve_units(dit_pipe, dit_pipe.transformer, "layerwise", ("transformer", "vae"))
    assert [u.name for u in dit] == ["transformer.head", "transformer.block0", "transformer.block1", "vae"]


@pytest.mark.parametrize("mode", ["model", "layerwise"])
def test_every_weight_in_exactly_one_unit(sd_pipe, mode):
    units = resolve_units(sd_pipe, sd_pipe.unet, mode, ())
    owned = [g.views[0].tensor.untyped_storage().data_ptr() for u in units for g in u.groups]
    assert len(owned) == len(set(owned))
    managed = {id(t) for u in units for t in u.tensors}
    for name in ("unet", "vae", "text_encoder"):
        module = getattr(sd_pipe, name)
        assert all(id(t) in managed for t in [*module.parameters(), *module.buffers()])
    assert sum(u.nbytes for u in units) == sum(u.materialised_bytes() for u in units)


def test_planning_moves_nothing(tiny_dit_path):
    pipe = DiffusionPipeline.from_pretrained(tiny_dit_path, local_files_only=True, low_cpu_mem_usage=False)
    before = snapshot(pipe.transformer)
    params = dict(pipe.transformer.named_parameters())
    ptrs = {n: t.data_ptr() for n, t in params.items()}
    units = resolve_units(pipe, pipe.transformer, "model", ("transformer",))
    for name, t in pipe.transformer.named_parameters():
        assert t is params[name] and t.data_ptr() == ptrs[name] and bitwise_equal(t, before[name])
    view = units[0].groups[0].views[0]
    assert (view.offset, view.size, view.stride) == (view.tensor.storage_offset(), view.tensor.size(),
                                                     view.tensor.stride())


def test_unknown_component_is_named(sd_pipe):
    with pytest.raises(ConfigError, match=r"offload.components=\['unet', 'transformer'\]: StableDiffusionPipeline "
                                          r"has no module component 'transformer' \(it has: .*unet"):
        resolve_units(sd_pipe, sd_pipe.unet, "model", ("unet", "transformer"))
