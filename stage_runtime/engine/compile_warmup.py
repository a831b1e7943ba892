"""The compile warm-up: small requests that make every rank compile, before the stage reports ready.

A compiled region gets one graph for a batch of 1 row and one for every batch of 2 rows or more (its batch dimension
is dynamic; dynamo specialises a dimension of size 1), per distinct layout of its inputs. So at each compile shape
(``compile.shapes``, else the model's default size and frames) three 2-step requests run, one after the other, in
the stage's own execution mode: unguided (1 row: guidance 0 turns CFG off in every family), guided with the
family's default guidance (2 rows in a CFG family), and two outputs guided (4 rows). A new shape at run time, the
rows a block-cache skip leaves, step batching's changing batch: all fall in those graphs.

A shape the model cannot serve is refused at startup, naming the shape (``compile.shapes: …``): the stage exits
with the reason instead of serving uncompiled sizes it was told to compile.
"""

from __future__ import annotations

import uuid

import numpy as np

from stage_runtime.config import CompileConfig, parse_shape
from stage_runtime.engine.output_table import WARMUP_PREFIX
from stage_runtime.model_info import ModelInfo
from stage_runtime.request import DiffusionRequest, EditInput, SamplingParams


def warmup_shapes(config: CompileConfig, info: ModelInfo) -> list[tuple[str, int, int, int | None]]:
    """(label, width, height, frames) of every compile shape; the model's default size when none is given."""
    if not config.shapes:
        return [("default", info.default_width, info.default_height, info.default_frames)]
    return [(shape, *parse_shape(shape)) for shape in config.shapes]


def compile_warmup_requests(config: CompileConfig, info: ModelInfo) -> list[tuple[str, DiffusionRequest]]:
    """(the shape's label, a request) for every warm-up request, in the order they run."""
    out = []
    for label, width, height, frames in warmup_shapes(config, info):
        grey = np.full((height, width, 3), 128, dtype=np.uint8)
        for guidance, n in ((0.0, 1), (None, 1), (None, 2)):
            sampling = SamplingParams(num_inference_steps=2, seed=0, height=height, width=width, num_outputs=n,
                                      guidance_scale=guidance, num_frames=frames if info.video else None)
            out.append((label, DiffusionRequest(f"{WARMUP_PREFIX}compile-{uuid.uuid4().hex[:8]}", "warmup", sampling,
                                                video=info.video,
                                                reference=grey if info.reference == "required" else None,
                                                edit=EditInput(grey) if info.edits_only else None)))
    return out
