"""The family hook's home: every adapter class's ``check_request`` is defined by a torch-free class of
``models.refusals`` that ``ModelInfo.refusals`` names, so the engine process runs a family's refusals without
importing torch or diffusers. (What each family refuses: tests/stage_runtime/engine/test_admission.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stage_runtime.models.registry import ADAPTERS, GENERIC
from stage_runtime.models.refusals import (DiTRefusals, GenericRefusals, Refusals, ZImageRefusals, class_id,
                                           refusals_path)
from stage_runtime.plugins import import_object

REPO_ROOT = Path(__file__).resolve().parents[3]
EXPECTED = {"DiTPipeline": DiTRefusals, "FluxPipeline": Refusals, "StableDiffusionPipeline": Refusals,
            "ZImagePipeline": ZImageRefusals}


def test_every_registered_adapter_inherits_its_check_from_the_class_its_model_info_names():
    paths = {}
    for name, adapter_path in {**ADAPTERS, "generic": GENERIC}.items():
        adapter = import_object(adapter_path)
        owner = import_object(refusals_path(adapter))
        assert adapter.check_request.__func__ is owner.check_request.__func__, name
        assert issubclass(adapter, owner) and owner.__module__ == "stage_runtime.models.refusals", name
        paths[name] = owner
    assert paths["generic"] is GenericRefusals and {k: paths[k] for k in EXPECTED} == EXPECTED


def test_the_refusal_classes_import_without_torch_or_diffusers():
    code = ("import sys\nfrom stage_runtime.engine.admission import family_check\n"
            "from stage_runtime.model_info import ModelInfo\n"
            "for name in ('Refusals', 'DiTRefusals', 'GenericRefusals', 'ZImageRefusals'):\n"
            "    family_check(ModelInfo('P', 'a:B', 64, 64, 20, 7.5, 8, False, True, True, 4,"
            " refusals='stage_runtime.models.refusals:' + name))\n"
            "bad = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]\nassert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_dit_prompt_maps_to_its_class_as_the_adapter_runs_it():
    labels = {"tench": 0, "goldfish": 1}
    assert [class_id(p, labels, 1000) for p in ("207", " 207 ", "goldfish", "5000")] == [207, 207, 1, 5000]
    assert class_id("a cat", {}, 1000) == 92                  # CRC32 (stable across processes), not hash()
    assert class_id("²", {}, 1000) == class_id("²", labels, 1000) < 1000      # a non-ASCII digit is text
