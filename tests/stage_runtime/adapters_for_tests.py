"""Model adapters with injected faults, loaded through the real registry override (``model.adapter``).

They are models with known behaviour (inputs to the system), not mocks of our components: the real
engine, scheduler, executor, worker and runner run around the real tiny diffusers pipeline.
"""

from __future__ import annotations

from stage_runtime.models.sd import StableDiffusionAdapter


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

    def step_scheduler(self, state, noise_pred):
        if state.request.prompt == "late-boom" and state.step_index == 2:
            raise RuntimeError("boom in step 3")
        super().step_scheduler(state, noise_pred)
