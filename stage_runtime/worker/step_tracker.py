"""Progress of one request-mode pipeline call, and where it stops: the phases a call goes through, reported to
the engine as they begin.

    encode      when the call starts (the prompt, and a reference image, are encoded first)
    denoise k   a forward pre-hook on the denoiser: one invocation = one denoising step; the engine answers with
                the ids it wants stopped, and the call unwinds once every request in it was stopped
    decode      a forward pre-hook on the VAE's decoder, once, after denoising (the VAE of a video is
                most of a call's time at real sizes: a client sees it is not stuck)

Step mode reports the same phases from the runner's tick (:func:`report_phase`), without hooks.
"""

from __future__ import annotations

import torch

from stage_runtime.outputs import ProgressEvent, ProgressHook


class Interrupted(Exception):
    """Every request of the running pipeline call was cancelled: unwind out of the denoising loop."""


def report_phase(hook: ProgressHook | None, request_ids, step_index: int, num_steps: int, phase: str) -> None:
    """A phase notice (encode, decode) to the engine; cancels are not agreed here (only at denoising steps)."""
    if hook is not None and request_ids:
        hook(ProgressEvent(tuple(request_ids), step_index, num_steps, phase))


def vae_decoder(pipe) -> torch.nn.Module | None:
    """The module a pipeline's VAE decode runs through (``vae.decoder``), when it has one."""
    decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
    return decoder if isinstance(decoder, torch.nn.Module) else None


class StepTracker:
    """The hooks of one pipeline call (request mode); :meth:`attach` installs them for the call's duration."""

    def __init__(self, request_ids: list[str], num_steps: int, hook: ProgressHook | None):
        self.request_ids = tuple(request_ids)
        self.num_steps = num_steps
        self.hook = hook
        self.step_index = 0                    # steps completed
        self.cancelled: set[str] = set()
        self.decoding = False

    def attach(self, denoiser: torch.nn.Module, pipe) -> list:
        """Report ``encode`` now; hook the denoiser (steps) and the VAE decoder (decode). Returns the handles."""
        report_phase(self.hook, self.request_ids, 0, self.num_steps, "encode")
        handles = [denoiser.register_forward_pre_hook(self)]
        decoder = vae_decoder(pipe)
        if decoder is not None:
            handles.append(decoder.register_forward_pre_hook(self.on_decode))
        return handles

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if self.hook is not None:
            event = ProgressEvent(self.request_ids, self.step_index, self.num_steps)
            self.cancelled.update(set(self.hook(event)) & set(self.request_ids))
        if len(self.cancelled) == len(self.request_ids):
            raise Interrupted()
        self.step_index += 1

    def on_decode(self, module: torch.nn.Module, args: tuple) -> None:
        if not self.decoding and self.step_index:          # the first decoder call after denoising (tiles: many)
            self.decoding = True
            live = [rid for rid in self.request_ids if rid not in self.cancelled]
            report_phase(self.hook, live, self.step_index, self.num_steps, "decode")
