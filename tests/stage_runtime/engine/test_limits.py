"""The request cost bound: pixels × steps × outputs against limits.max_request_cost, by default 1000 steps of
one output at the model's native size; the refusal names the field to shrink and every factor."""

from __future__ import annotations

import pytest
from support.factories import make_request, model_info

from stage_runtime.config import LimitsConfig
from stage_runtime.engine.limits import check_request_cost, max_request_cost, request_cost
from stage_runtime.errors import InvalidRequestError

INFO = model_info(default_height=512, default_width=512)
DEFAULT = max_request_cost(LimitsConfig(), INFO)


def resolved(**sampling):
    return make_request("r", **sampling).resolve(INFO)


def test_the_default_is_1000_steps_of_one_output_at_the_native_size():
    assert DEFAULT == 512 * 512 * 1000
    assert max_request_cost(LimitsConfig(max_request_cost=12345), INFO) == 12345


def test_cost_is_pixels_times_steps_times_outputs():
    assert request_cost(resolved(height=256, width=128, num_inference_steps=7, num_outputs=3)) == 256 * 128 * 7 * 3


def test_everything_the_step_limit_admits_at_the_native_size_passes():
    check_request_cost(resolved(num_inference_steps=1000), DEFAULT, INFO)
    check_request_cost(resolved(height=1024, width=1024, num_inference_steps=250), DEFAULT, INFO)


@pytest.mark.parametrize(("sampling", "field", "value"), [
    ({"height": 4096, "width": 4096, "num_inference_steps": 50}, "size", "4096x4096"),     # the wedge
    ({"num_inference_steps": 1000, "num_outputs": 2}, "n", 2),
    ({"height": 256, "width": 256, "num_inference_steps": 1000, "num_outputs": 16}, "n", 16),
])
def test_an_over_cost_request_is_a_400_naming_what_to_shrink(sampling, field, value):
    with pytest.raises(InvalidRequestError) as caught:
        check_request_cost(resolved(**sampling), DEFAULT, INFO)
    assert (caught.value.field, caught.value.value) == (field, value)
    assert "is over this stage's limit of 262,144,000" in caught.value.reason
    assert "spec.engine.maxRequestCost" in caught.value.reason and "native 512x512" in caught.value.reason


def test_steps_are_named_when_neither_size_nor_outputs_are_over():
    with pytest.raises(InvalidRequestError) as caught:
        check_request_cost(resolved(num_inference_steps=20), 512 * 512 * 10, INFO)
    assert caught.value.field == "num_inference_steps" and caught.value.value == 20
    assert "512x512 px x 20 steps x 1 output(s) = 5,242,880 pixel-steps" in caught.value.reason
