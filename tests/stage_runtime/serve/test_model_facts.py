"""A family's facts (modes, parallel kinds, guidance semantics, defaults, limits: ModelInfo) are served to
clients and the operator in /v1/models (issue 14, scope 5): here for Qwen-Image's true-CFG family."""

from __future__ import annotations

from dataclasses import asdict

from family_checks import make_engine

from stage_runtime.config import load_config
from stage_runtime.serve.metrics import StageMetrics
from stage_runtime.serve.models_route import model_card
from stage_runtime.serve.service import StageService


def test_models_card_serves_the_family_facts(tiny_qwen_image_path):
    engine = make_engine(tiny_qwen_image_path, warmup=False)
    try:
        service = StageService(load_config({"model": {"path": tiny_qwen_image_path}, "device": "cpu"}),
                               StageMetrics())
        service.attach(engine)
        facts = model_card(service)["diffstage"]
        assert {k: facts[k] for k in asdict(engine.model_info)} == asdict(engine.model_info)
        assert (facts["pipeline_class"], facts["guidance"], facts["parallel_kinds"], facts["default_guidance"]) == (
            "QwenImagePipeline", "true_cfg", ("cfg", "ring", "ulysses"), 4.0)
    finally:
        engine.close()
