"""The built-in ``tiny-digits``: the trained class-conditional DiT that draws handwritten digits (32x32).

Not random: its weights were trained here by ``stage-runtime train-tiny`` (stage_runtime.train) and ship in
``trained/digits/`` with their digest and the exact command in ``trained/MANIFEST.json`` (docs/trained-model.md).
The prompt names the digit: "0".."9" (DiT's decimal class ids) or "zero".."nine" (its ``id2label``).
"""

from __future__ import annotations

import json

from stage_runtime.models.tiny.digit_judge import TRAINED

FOLDER = TRAINED / "digits"


def build(seed: int):
    """The shipped pipeline, loaded (``seed`` is unused: trained weights are not drawn). ``id2label`` is
    registered again so that ``save_pretrained`` writes it to model_index.json as the shipped folder has it."""
    from diffusers import DiTPipeline

    pipe = DiTPipeline.from_pretrained(FOLDER, local_files_only=True)
    pipe.register_to_config(id2label=json.loads((FOLDER / "model_index.json").read_text())["id2label"])
    return pipe
