"""The per-row hook: rows without adapters are the base forward bitwise; rows with a set get exactly their own
delta (PEFT's formula); a wrong row count or a missing plan is an error, never a silent base output."""

from __future__ import annotations

import pytest
import torch

from stage_runtime.models.lora.files import LoraFactors, LoraWeights
from stage_runtime.models.lora.layer import LoraRowsError, RowPlan
from stage_runtime.models.lora.manager import LoraManager


def manager_with(module: torch.nn.Module, factors: dict[str, LoraFactors]) -> LoraManager:
    from diffusers import StableDiffusionPipeline

    manager = LoraManager({"unet": torch.nn.ModuleDict({"m": module})}, torch.device("cpu"), StableDiffusionPipeline)
    for name, f in factors.items():       # what load() does after read_lora
        manager.add(LoraWeights(name, "-", name * 16, {"unet": {"m": f}}))
    return manager


def test_row_plan_groups_rows_by_their_adapter_set():
    a, ab = (("a", 1.0),), (("a", 0.5), ("b", 0.5))
    plan = RowPlan.of([(), a, ab, a], torch.device("cpu"))
    assert plan.rows == 4 and [(idx.tolist(), s) for idx, s in plan.groups] == [([1, 3], a), ([2], ab)]
    assert RowPlan.of([a, a], torch.device("cpu")).groups == ((None, a),)
    assert RowPlan.of([(), ()], torch.device("cpu")).groups == ()


@pytest.mark.parametrize("module, x", [(torch.nn.Linear(8, 6), torch.randn(4, 3, 8)),
                                       (torch.nn.Conv2d(3, 5, 3, padding=1), torch.randn(4, 3, 6, 6))])
def test_each_row_gets_its_own_delta_and_plain_rows_are_the_base(module, x):
    torch.manual_seed(0)
    conv = isinstance(module, torch.nn.Conv2d)
    fa = LoraFactors(torch.randn(2, 3, 3, 3) if conv else torch.randn(2, 8),
                     torch.randn(5, 2, 1, 1) if conv else torch.randn(6, 2), 2.0)
    fb = LoraFactors(torch.randn_like(fa.a), torch.randn_like(fa.b), 0.5)
    manager = manager_with(module, {"a": fa, "b": fb})
    base = module(x)

    def peft(f, rows):                     # PEFT: result + lora_B(lora_A(x)) * scaling
        h = (torch.nn.functional.conv2d(torch.nn.functional.conv2d(rows, f.a, padding=1), f.b) if conv
             else rows @ f.a.T @ f.b.T)
        return h

    with manager.rows("unet", [(), (("a", 0.8),), (("a", 0.5), ("b", -1.0)), ()]):
        out = module(x)
    assert torch.equal(out[0], base[0]) and torch.equal(out[3], base[3])
    torch.testing.assert_close(out[1], base[1] + peft(fa, x[1:2])[0] * (0.8 * 2.0))
    torch.testing.assert_close(out[2], base[2] + peft(fa, x[2:3])[0] * 1.0 - peft(fb, x[2:3])[0] * 0.5)
    assert torch.equal(module(x), base), "the plan is cleared after the call"
    assert manager.forward_calls() == 1


@pytest.mark.parametrize("module, x", [(torch.nn.Linear(8, 6), torch.randn(1, 3, 8)),
                                       (torch.nn.Conv2d(3, 5, 3, padding=1), torch.randn(1, 3, 6, 6))])
def test_a_lora_bias_is_added_with_the_factors_and_scaled_like_them(module, x):
    """PEFT's lora_bias (diffusers' reading of a Wan file's diff_b): result + (lora_B(lora_A(x)) + bias) · scaling.
    Three identical rows: the same factors without and with the bias, and none."""
    torch.manual_seed(1)
    conv = isinstance(module, torch.nn.Conv2d)
    x = x.expand(3, *x.shape[1:]).contiguous()
    plain = LoraFactors(torch.randn(2, 3, 3, 3) if conv else torch.randn(2, 8),
                        torch.randn(5, 2, 1, 1) if conv else torch.randn(6, 2), 2.0)
    bias = torch.randn(5 if conv else 6)
    manager = manager_with(module, {"plain": plain, "biased": LoraFactors(plain.a, plain.b, 2.0, bias)})
    base = module(x)
    with manager.rows("unet", [(("plain", 0.7),), (("biased", 0.7),), ()]):
        out = module(x)
    torch.testing.assert_close(out[1] - out[0], (bias.view(-1, 1, 1) if conv else bias).expand_as(out[0]) * 1.4)
    assert not torch.equal(out[0], base[0]) and torch.equal(out[2], base[2])


def test_a_wrong_row_count_or_a_missing_plan_under_the_guard_is_an_error():
    module = torch.nn.Linear(8, 6)
    manager = manager_with(module, {"a": LoraFactors(torch.randn(2, 8), torch.randn(6, 2), 1.0)})
    with manager.rows("unet", [(("a", 1.0),)] * 3), pytest.raises(LoraRowsError, match="4 rows in the call, the "
                                                                                      "LoRA row plan has 3"):
        module(torch.randn(4, 8))
    with manager.guard(True), pytest.raises(LoraRowsError, match="unet.m ran without LoRA rows"):
        module(torch.randn(4, 8))
    module(torch.randn(4, 8))            # no request with adapters in the call: the base forward
    with pytest.raises(Exception, match="not loaded on this rank"):
        with manager.rows("unet", [(("zz", 1.0),)]):
            pass
    manager.unload("a")
    with manager.rows("unet", [(("a", 1.0),)] * 0 + [()] * 4):
        assert torch.equal(module(torch.ones(4, 8)), torch.nn.Linear.forward(module, torch.ones(4, 8)))


def test_a_family_without_lora_components_refuses_startup_adapters_naming_why():
    from types import SimpleNamespace

    from stage_runtime.config import load_config
    from stage_runtime.errors import LoraLoadError
    from stage_runtime.models.lora.manager import build_lora_manager

    with pytest.raises(LoraLoadError, match="serves no LoRA adapters"):
        build_lora_manager(SimpleNamespace(pipe=SimpleNamespace(unet=torch.nn.Linear(2, 2)), lora_components=()),
                           load_config({"model": {"path": "/m"}, "loras": [{"name": "a", "path": "/a"}]}),
                           torch.device("cpu"))


def test_a_plan_cut_to_some_rows_follows_them_even_a_repeated_row():
    """A CFG-parallel rank's chunk (``[2, 3, 3]``: the last row repeated as padding) or the block cache's
    computing rows: each kept row carries the set it had, renumbered."""
    from stage_runtime.models.lora.layer import RowPlan

    a, b = (("a", 1.0),), (("b", 0.5),)
    plan = RowPlan.of([a, (), b, a], torch.device("cpu"))
    cut = plan.subset(torch.tensor([2, 3, 3]), torch.device("cpu"))
    sets = [()] * cut.rows
    for idx, s in cut.groups:
        for row in range(cut.rows) if idx is None else idx.tolist():
            sets[row] = s
    assert cut.rows == 3 and sets == [b, a, a]
    assert plan.subset(torch.tensor([1]), torch.device("cpu")).groups == ()
