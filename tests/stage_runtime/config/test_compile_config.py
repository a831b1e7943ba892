"""``compile:`` in the stage config (stage_runtime/config/compile.py): modes, shapes, bounds, and the combination
with layerwise offload refused at the edge, each with a message naming the field and the value."""

from __future__ import annotations

import pytest

from stage_runtime.config import ConfigError, load_config, parse_shape


def config(**compile_fields) -> dict:
    return {"model": {"path": "m"}, "compile": compile_fields}


def test_the_default_is_eager_and_every_mode_is_accepted():
    assert load_config({"model": {"path": "m"}}).compile.mode == "none"
    for mode in ("none", "auto", "regional", "full"):
        assert load_config(config(mode=mode)).compile.enabled is (mode != "none")


@pytest.mark.parametrize("shape, parsed", [("64x48", (64, 48, None)), ("832x480x81", (832, 480, 81)),
                                           ("1x1", (1, 1, None))])
def test_shapes_are_width_by_height_and_frames_for_video(shape, parsed):
    assert parse_shape(shape) == parsed
    assert load_config(config(mode="regional", shapes=[shape])).compile.shapes == (shape,)


@pytest.mark.parametrize("fields, message", [
    ({"mode": "fast"}, "compile.mode='fast': Input should be 'none', 'auto', 'regional' or 'full'"),
    ({"mode": "regional", "shapes": ["64"]}, "compile shape '64' must be WIDTHxHEIGHT or WIDTHxHEIGHTxFRAMES"),
    ({"mode": "regional", "shapes": ["0x64"]}, "compile shape '0x64' must be"),
    ({"mode": "regional", "shapes": ["64x64", "64x64"]}, "compile shape(s) listed twice: 64x64"),
    ({"mode": "regional", "shapes": [f"{i + 1}x8" for i in range(17)]}, "at most 16 compile shapes, got 17"),
    ({"mode": "regional", "max_graphs": 0}, "compile.max_graphs=0: Input should be greater than or equal to 1"),
    ({"mode": "regional", "timeout_s": 0}, "compile.timeout_s=0: Input should be greater than 0"),
    ({"mode": "regional", "unknown": 1}, "unknown field compile.unknown"),
])
def test_bad_compile_settings_are_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as info:
        load_config(config(**fields))
    assert message in str(info.value)


def test_compile_with_layerwise_offload_is_refused_saying_why():
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"path": "m"}, "compile": {"mode": "regional"}, "offload": {"mode": "layerwise"}})
    assert "compile.mode='regional' with offload.mode='layerwise': layerwise offload swaps the weights" in str(info.value)
    load_config({"model": {"path": "m"}, "compile": {"mode": "none"}, "offload": {"mode": "layerwise"}})
