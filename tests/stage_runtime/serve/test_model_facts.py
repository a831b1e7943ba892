"""A family's facts (modes, parallel kinds, guidance semantics, defaults, limits: ModelInfo) are served in
/v1/stats so clients and the operator can read them (issue 14, scope 5)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from family_probes import make_engine

from stage_runtime.config import load_config
from stage_runtime.serve.metrics import StageMetrics
from stage_runtime.serve.service import StageService


@pytest.mark.xfail(strict=True, reason="needs serve wiring: StageService.stats() does not include ModelInfo yet")
def test_stats_serve_the_family_facts(tiny_qwen_image_path):
    engine = make_engine(tiny_qwen_image_path, warmup=False)
    try:
        service = StageService(load_config({"model": {"path": tiny_qwen_image_path}, "device": "cpu"}),
                               StageMetrics())
        service.attach(engine)
        model = service.stats()["model"]
        assert model == asdict(engine.model_info)
        assert (model["pipeline_class"], model["guidance"], model["parallel_kinds"]) == (
            "QwenImagePipeline", "true_cfg", ("cfg", "ulysses"))
    finally:
        engine.close()
