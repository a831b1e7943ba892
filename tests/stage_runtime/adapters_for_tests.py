"""Model adapters with injected faults, loaded through the real registry override (``model.adapter``).

They are models with known behaviour (inputs to the system), not mocks of our components: the real
engine, scheduler, executor, worker and runner run around the real tiny diffusers pipeline.
"""

from __future__ import annotations

import json
import os
import time

from stage_runtime.models.families.dit import DiTAdapter
from stage_runtime.models.families.sd import StableDiffusionAdapter
from stage_runtime.models.families.zimage import ZImageAdapter


class RecordingSDAdapter(StableDiffusionAdapter):
    """Records every pipeline call; prompt "boom" makes the call raise, "drop" loses that request's output."""

    calls: list[list[str]] = []

    def run_batch(self, requests):
        type(self).calls.append([r.request_id for r in requests])
        if any("boom" in r.prompt for r in requests):
            raise RuntimeError("boom requested by the prompt")
        images = super().run_batch(requests)
        for r in requests:
            if "drop" in r.prompt:
                images.pop(r.request_id)
        return images


class AlwaysFailingSDAdapter(StableDiffusionAdapter):
    def run_batch(self, requests):
        raise RuntimeError("this model cannot generate")


class SingleRequestSDAdapter(StableDiffusionAdapter):
    supports_request_batch = False


class RequestOnlySDAdapter(StableDiffusionAdapter):
    """Declares no step contract (as a diffusers black-box adapter would)."""

    supports_step_execution = False


class StepFaultSDAdapter(StableDiffusionAdapter):
    """Step mode: prompt "boom" fails in prepare_encode, "late-boom" fails in its third scheduler step."""

    def prepare_encode(self, request):
        if request.prompt == "boom":
            raise RuntimeError("boom in prepare_encode")
        return super().prepare_encode(request)

    def noise_step(self, state, noise_pred):
        if state.request.prompt == "late-boom" and state.step_index == 2:
            raise RuntimeError("boom in step 3")
        super().noise_step(state, noise_pred)


class TracingSDAdapter(StableDiffusionAdapter):
    """Appends one JSON line per pipeline call (pid, request ids, start/end on the monotonic clock) to the
    file named by DIFFSTAGE_TEST_TRACE: shows which rank process ran what, and when."""

    def run_batch(self, requests):
        start = time.monotonic()
        images = super().run_batch(requests)
        with open(os.environ["DIFFSTAGE_TEST_TRACE"], "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "ids": [r.request_id for r in requests],
                                "start": start, "end": time.monotonic()}) + "\n")
        return images


class StallOnRankOneSDAdapter(StableDiffusionAdapter):
    """Prompt "stall" makes rank 1 sleep before the pipeline call: its peers wait in a collective that
    times out (collective_timeout_s) — the worker group must fail closed, not hang."""

    def run_batch(self, requests):
        import torch.distributed as dist

        if any("stall" in r.prompt for r in requests) and dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(60)
        return super().run_batch(requests)


class StepFaultDiTAdapter(DiTAdapter):
    """Step mode, DiT (block cache): prompt "late-boom" fails in its third scheduler step."""

    def noise_step(self, state, noise_pred):
        if state.request.prompt == "late-boom" and state.step_index == 2:
            raise RuntimeError("boom in step 3")
        super().noise_step(state, noise_pred)


class HangUntilFileSDAdapter(StableDiffusionAdapter):
    """Prompt "hang:PATH" blocks the pipeline call until PATH exists: a step that makes no progress (a wedged
    kernel, a size far past the hardware), released when the test says so, or never."""

    def run_batch(self, requests):
        for r in requests:
            if r.prompt.startswith("hang:"):
                while not os.path.exists(r.prompt[len("hang:"):]):
                    time.sleep(0.02)
        return super().run_batch(requests)


class NeverLoadsSDAdapter(StableDiffusionAdapter):
    """Its model load never finishes (a read from a hung network volume): the rank never says it is ready, however
    fast the machine."""

    @classmethod
    def load(cls, path, device, dtype="float32"):
        import threading

        threading.Event().wait()              # until the executor gives up on the rank and ends it


class TruncatedZImageAdapter(ZImageAdapter):
    """Z-Image with ZImagePipeline's other two guidance knobs set (no request field sets them): CFG truncated past
    (1000 - t) / 1000 > 0.6 (the last steps run positive rows only) and the guided prediction's norm capped at 1.05
    times the positive one's."""

    cfg_truncation = 0.6
    cfg_normalization = 1.05
