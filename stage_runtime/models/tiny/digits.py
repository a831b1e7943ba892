"""The built-in ``tiny-digits``: the trained class-conditional DiT that draws handwritten digits (32x32).

Not random: its weights were trained here by ``stage-runtime train-tiny`` (stage_runtime.train) and ship in
``trained/digits/`` with their digest and the exact command in ``trained/MANIFEST.json`` (docs/trained-model.md).
The prompt names the digit: "0".."9" (DiT's decimal class ids) or "zero".."nine" (its ``id2label``).
"""

from __future__ import annotations

import json

from stage_runtime.models.tiny.digit_judge import TRAINED

FOLDER = TRAINED / "digits"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _component(cls, name: str):
    """A model of the shipped folder from its config and its weights (``from_pretrained`` would record its
    source path in the config, and ``save_pretrained`` would write it: the files would differ from the shipped)."""
    from safetensors.torch import load_file

    model = cls.from_config(cls.load_config(FOLDER / name))
    model.load_state_dict(load_file(str(FOLDER / name / WEIGHTS)))
    return model.eval()


def build(seed: int):
    """The shipped pipeline (``seed`` is unused: trained weights are not drawn); ``save_pretrained`` of it writes the
    shipped files bitwise, ``id2label`` included."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    id2label = {int(k): v for k, v in json.loads((FOLDER / "model_index.json").read_text())["id2label"].items()}
    with torch.random.fork_rng(devices=[]):            # constructing draws initial weights (then replaced)
        transformer, vae = _component(DiTTransformer2DModel, "transformer"), _component(AutoencoderKL, "vae")
    scheduler = DDIMScheduler.from_config(DDIMScheduler.load_config(FOLDER / "scheduler"))
    pipe = DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler, id2label=id2label)
    pipe.register_to_config(id2label=id2label)
    return pipe
