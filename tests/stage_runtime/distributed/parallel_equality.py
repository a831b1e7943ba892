"""Shared body of the CFG-parallel and Ulysses equality tests (2 real gloo ranks vs one plain rank)."""

from __future__ import annotations

import dist_rank_checks as checks
import numpy as np
import pytest

KINDS = ("sd", "dit")


def check_images(payloads: dict, references: dict, kind: str) -> None:
    ref = references[kind]
    # The references are not trivial: different requests give clearly different images (videos by less: the
    # tiny Wan's VAE dominates them; its denoiser's outputs are compared in float, check_denoiser_outputs).
    assert all(img.std() > 10 for img in ref.values())
    first = next(iter(ref))
    assert checks.max_abs_diff(ref[first], ref[first.split("/")[0] + "/b"]) > (20 if ref[first].ndim == 5 else 50)
    assert not checks.image_mismatches(payloads, ref, kind, tol=2), checks.image_mismatches(payloads, ref, kind)
    for name in ref:   # every rank returns the same (gathered) result
        np.testing.assert_array_equal(payloads[0][kind][name], payloads[1][kind][name])


def check_denoiser_outputs(payloads: dict, references: dict, kind: str, atol: float = 1e-5) -> None:
    """The directly called transformer / denoiser (dist_rank_checks.transformer_outputs) equals one rank's on
    every rank, in float."""
    ref = references[f"{kind}-transformer"]
    assert ref, kind
    for rank, payload in payloads.items():
        assert sorted(payload[f"{kind}-transformer"]) == sorted(ref)
        for name, expected in ref.items():
            np.testing.assert_allclose(payload[f"{kind}-transformer"][name], expected, rtol=0, atol=atol,
                                       err_msg=f"rank {rank} {kind} {name}")


def check_scenarios_cover_the_brief(references: dict) -> None:
    for kind in KINDS:
        names = set(references[kind])
        for mode in ("request", "request1", "step"):
            assert any(n.startswith(f"{mode}-g1/") for n in names), (kind, mode)
            assert any(n.startswith(f"{mode}-g") and not n.startswith(f"{mode}-g1/") for n in names), (kind, mode)


kind_param = pytest.mark.parametrize("kind", KINDS)
