"""The ``offload`` section of the stage config: defaults, and every rejection names the field and its value."""

from __future__ import annotations

import pytest

from stage_runtime.config import OffloadConfig, load_config
from stage_runtime.errors import ConfigError


def cfg(**offload):
    return load_config({"model": {"path": "/m"}, "offload": offload})


def test_defaults_are_off_and_round_trip():
    c = cfg()
    assert c.offload == OffloadConfig() and c.offload.mode == "none"
    on = cfg(mode="layerwise", components=["transformer"], resident_layers=3, max_host_bytes=10**6, dir="/d")
    assert on.offload.components == ("transformer",)
    assert load_config(on.model_dump()) == on and load_config(c.model_dump()) == c


@pytest.mark.parametrize("offload, message", [
    ({"mode": "fast"}, r"offload.mode='fast': Input should be 'none', 'model', 'layerwise' or 'distributed'"),
    ({"mode": "model", "max_host_bytes": 0}, r"offload.max_host_bytes=0: Input should be greater than or equal to 1"),
    ({"mode": "layerwise", "resident_layers": 0}, r"offload.resident_layers=0: Input should be greater"),
    ({"mode": "layerwise", "resident_layers": 1}, r"offload: resident_layers=1 must be >= 2 with prefetch=True"),
    ({"mode": "model", "components": ["vae", "vae"]}, r"offload.components=\['vae', 'vae'\]: .*listed twice: vae"),
    ({"mode": "model", "components": ["unet/0"]}, r"offload.components=\['unet/0'\]: .*got 'unet/0'"),
    ({"mode": "none", "components": ["vae"]}, r"offload: components is set but mode='none'"),
    ({"mode": "model", "prefetch": False},
     r"offload: prefetch only applies to mode='layerwise' or 'distributed' \(mode='model'\)"),
    ({"mode": "model", "resident_layers": 4}, r"offload: resident_layers only applies to mode='layerwise'"),
    ({"mode": "model", "dir": ""}, r"offload.dir='': String should have at least 1 character"),
    ({"mode": "model", "bogus": 1}, r"unknown field offload.bogus"),
])
def test_rejections_name_the_field(offload, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**offload)


def test_layerwise_without_prefetch_may_keep_one_block():
    assert cfg(mode="layerwise", prefetch=False, resident_layers=1).offload.resident_layers == 1
