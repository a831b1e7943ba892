"""Rank-side code of the distributed tests: runs in spawned processes (and in the test process for references).

Kept out of the test modules so ``spawn`` children can import it by name (the test folder is put on
``sys.path`` by the test module; spawn hands the parent's ``sys.path`` to its children).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

from denoiser_outputs import transformer_outputs  # noqa: F401 - the ranks' and the references' direct calls

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

TIMEOUT_S = 30.0
PEER_TIMEOUT_S = 2.0        # the lost-peer checks' collective timeout
VIDEO_SIDE = {"LTX2Pipeline": 64,           # LTX-2's VAE needs two latent pixels a side (x32); others 32
              "HunyuanVideo15Pipeline": 16,  # HunyuanVideo-1.5: its 1985 context tokens a row are what cost
              "HunyuanVideo15ImageToVideoPipeline": 16}
WITH_PICTURE = ("b", "s2")                   # where a picture is optional (LTX-2): these requests carry one


def free_ports(n: int) -> list[int]:
    """``n`` distinct free localhost ports (all bound at once, so they cannot repeat)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def load_adapter(path: str):
    import torch

    from stage_runtime.config import ModelConfig
    from stage_runtime.models.registry import resolve_adapter_class

    return resolve_adapter_class(ModelConfig(path=path)).load(path, torch.device("cpu"))


def picture(side: int):
    """A deterministic uint8 (side, side, 3) picture for image-to-video: gradients and a bright square."""
    import numpy as np

    ramp = np.linspace(0, 255, side)
    image = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, 255 - ramp) / 2,
                      np.full((side, side), 96.0)], axis=-1)
    image[side // 4:side // 2, side // 4:side // 2] = 240
    return image.round().astype(np.uint8)


def source_video(side: int, frames: int = 9):
    """Wan VACE's video-to-video input: :func:`picture` drifting a pixel a frame, a mask generating its left half,
    and the picture mirrored as one reference image."""
    import numpy as np

    from stage_runtime.video_request import VideoInput

    base = picture(side)
    clip = np.stack([np.roll(base, k, axis=1) for k in range(frames)])
    mask = np.zeros_like(clip)
    mask[:, :, : side // 2] = 255
    return VideoInput(clip, mask, (np.ascontiguousarray(base[:, ::-1]),))


def _request(adapter, rid: str, prompt: str, steps: int, seed: int, guidance: float, **kw):
    """Every tiny image model's 64 px (Qwen-Image's default is 512); a video model's 32 px (LTX-2 64, HunyuanVideo-1.5
    16: 4 x 4 x 3 = 48 video tokens a row; its 1985 context tokens a row are what cost), 9 frames (Wan: 2 x 2 x 3 =
    12 tokens a row, TI2V 3; LTX-2 8); with Wan 2.2's two experts, a second guidance scale when guided; a picture
    where the family needs one (Wan I2V), or for some requests where it takes one (LTX-2: text- and image-to-video
    rows then share forwards); Wan VACE's requests carry a source video, its mask and a reference image."""
    from stage_runtime.request import DiffusionRequest, SamplingParams

    info = adapter.info()
    side = VIDEO_SIDE.get(info.pipeline_class, 32)
    shape = {"height": side, "width": side, "num_frames": 9} if info.video else {"height": 64, "width": 64}
    if info.takes_guidance_2 and guidance > 1:
        shape["guidance_scale_2"] = guidance + 3
    given = info.reference == "required" or (info.reference == "optional" and rid in WITH_PICTURE)
    req = DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=steps, seed=seed,
                                                       guidance_scale=guidance, **{**shape, **kw}), video=info.video,
                           reference=picture(side) if given else None)
    if info.video_input:
        req.video_input = source_video(side)
    return req.resolve(info)


def run_steps(adapter, requests) -> dict:
    """The step contract: prepare_encode, batched denoise_step / noise_step until done, post_decode."""
    states = [adapter.prepare_encode(r) for r in requests]
    while active := [st for st in states if not st.finished]:
        for st, pred in zip(active, adapter.denoise_step(active), strict=True):
            adapter.noise_step(st, pred)
    return {st.request_id: adapter.post_decode(st) for st in states}


def scenarios(adapter) -> dict:
    """Every image the equality tests compare, keyed ``<scenario>/<request id>`` (uint8 arrays)."""
    import torch

    from stage_runtime.outputs import Decoded

    out: dict = {}
    with torch.inference_mode():
        for guidance in (adapter.default_guidance, 1.0):
            tag = f"g{guidance:g}"
            batch = [_request(adapter, "a", "17", 2, 1, guidance), _request(adapter, "b", "red car", 2, 2, guidance)]
            for rid, img in adapter.run_batch(batch).items():
                out[f"request-{tag}/{rid}"] = Decoded.of(img).images       # LTX-2's come with their sound
            single = [_request(adapter, "c", "3", 2, 3, guidance)]
            for rid, img in adapter.run_batch(single).items():
                out[f"request1-{tag}/{rid}"] = Decoded.of(img).images
            # 3 rows at guidance 1 (odd: padded split), then 1 row once s2 is done.
            steps = [_request(adapter, "s3", "42", 3, 4, guidance),
                     _request(adapter, "s2", "a cat", 2, 5, guidance, num_outputs=2)]
            for rid, img in run_steps(adapter, steps).items():
                out[f"step-{tag}/{rid}"] = img
    return out


def counting_denoiser_hooks(adapter, fn) -> tuple[object, int]:
    """``fn(adapter)`` with a forward pre-hook on the denoiser: (result, number of times the hook fired)."""
    calls = [0]

    def count(_module, _args):
        calls[0] += 1

    handle = adapter.denoiser.register_forward_pre_hook(count)
    try:
        return fn(adapter), calls[0]
    finally:
        handle.remove()


def replaced_processor_error(adapter) -> str | None:
    """Swap one Ulysses processor back to diffusers' default: the next denoiser call must refuse to run."""
    import torch
    from diffusers.models.attention_processor import AttnProcessor2_0

    if type(adapter.denoiser).__name__ in ("WanExperts", "WanVACEExperts"):   # Wan: the first expert's first block
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        adapter.denoiser.transformer.blocks[0].attn1.set_processor(WanAttnProcessor())
    elif type(adapter.denoiser).__name__ == "HunyuanVideo15Transformer3DModel":   # its own processor
        from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

        adapter.denoiser.transformer_blocks[0].attn.set_processor(HunyuanVideo15AttnProcessor2_0())
    elif type(adapter.denoiser).__name__ == "QwenImageTransformer2DModel":   # Qwen-Image: its own processor
        from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

        adapter.denoiser.transformer_blocks[0].attn.set_processor(QwenDoubleStreamAttnProcessor2_0())
    elif hasattr(adapter.denoiser, "transformer_blocks"):     # DiT: one block
        adapter.denoiser.transformer_blocks[0].attn1.set_processor(AttnProcessor2_0())
    else:                                                   # UNet: every attention, as set_attn_processor does
        adapter.denoiser.set_attn_processor(AttnProcessor2_0())
    try:
        with torch.inference_mode():
            run_steps(adapter, [_request(adapter, "r", "1", 1, 0, 1.0)])
    except RuntimeError as exc:
        return str(exc)
    return None


def run_rank(rank: int, world: int, rendezvous: list[str], runs: list[dict], results,
             jobs_module: str | None = None) -> None:
    """Entry point of one spawned rank. For each run (in order): init a world from ``run['parallel']``
    at its own rendezvous, run ``JOBS[run['job']]`` (this module's table, or ``jobs_module``'s: a spawned
    child imports it by name), destroy. Reports the payloads (one per run) or the error.
    A job returning ``{"exit": True}`` makes this rank's process exit right after reporting."""
    import importlib

    import torch

    torch.set_num_threads(1)
    try:
        from stage_runtime.config import ParallelConfig
        from stage_runtime.distributed.groups import destroy_distributed, init_distributed

        jobs = importlib.import_module(jobs_module).JOBS if jobs_module else JOBS
        payloads = []
        for init_method, run in zip(rendezvous, runs, strict=True):
            parallel = ParallelConfig(**run["parallel"])
            groups = init_distributed(parallel, rank, init_method, torch.device("cpu"),
                                      run.get("timeout_s", TIMEOUT_S))
            try:
                payloads.append(jobs[run["job"]](rank, groups, parallel, run))
            finally:
                destroy_distributed()
        results.put((rank, "ok", payloads))
        if payloads and payloads[-1].get("exit"):
            results.close()
            results.join_thread()
            os._exit(0)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _job_models(rank, groups, parallel, run) -> dict:
    from stage_runtime.distributed.apply import apply_parallelism

    payload = {"groups": {"coords": tuple(groups.coords), "leader": groups.is_replica_leader,
                          "replica_ranks": groups.replica_ranks, "dp": (groups.dp_rank, groups.dp_size)}}
    for kind, path in run["models"].items():
        adapter = load_adapter(path)
        apply_parallelism(adapter, groups, parallel)
        payload[f"{kind}-installed"] = installed(adapter.denoiser)
        payload[kind], payload[f"{kind}-hook-calls"] = counting_denoiser_hooks(adapter, scenarios)
        payload[f"{kind}-transformer"] = transformer_outputs(adapter)
        if parallel.ulysses_degree > 1:
            payload[f"{kind}-replaced"] = replaced_processor_error(adapter)
    return payload


def installed(denoiser) -> dict:
    """What parallelism is installed on a denoiser: CFG forward wrapper, number of Ulysses processors."""
    from stage_runtime.distributed.ulysses import UlyssesAttnProcessor
    from stage_runtime.models.families.hunyuan_video15 import HunyuanVideo15UlyssesAttnProcessor
    from stage_runtime.models.families.qwen_image import QwenUlyssesAttnProcessor
    from stage_runtime.models.families.wan_ulysses import WanUlyssesAttnProcessor

    ulysses = (UlyssesAttnProcessor, QwenUlyssesAttnProcessor, WanUlyssesAttnProcessor,
               HunyuanVideo15UlyssesAttnProcessor)
    return {"cfg": getattr(denoiser, "_diffstage_cfg_parallel", None) is not None,
            "ulysses": sum(isinstance(getattr(m, "processor", None), ulysses) for m in denoiser.modules())}


def _job_peer_gone(rank, groups, parallel, run) -> dict:
    """Rank 1 does not join rank 0's all_gather: it stalls past the timeout (``run['peer'] == 'stall'``)
    or its process exits (``'exit'``: must be the last run). Rank 0 must get a CollectiveError, not hang."""
    import torch

    from stage_runtime.distributed.comm import CollectiveError, all_gather_cat

    if rank == 1:
        if run["peer"] == "stall":
            time.sleep(run["timeout_s"] + 0.5)
        return {"left": run["peer"], "exit": run["peer"] == "exit"}
    if run["peer"] == "exit":
        time.sleep(1.0)
    start = time.monotonic()
    try:
        all_gather_cat(torch.ones(4), groups.cfg_group)
    except CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


JOBS = {"models": _job_models, "peer_gone": _job_peer_gone}


class Ranks:
    """``world`` processes running :func:`run_rank` with ``jobs_module``'s job table (default: this module's),
    forked from the executor's fork server as the engine's ranks are; :meth:`wait` returns each rank's payload."""

    def __init__(self, world: int, runs: list[dict], jobs_module: str | None = None):
        from stage_runtime.executor.procs import worker_context

        ctx = worker_context("forkserver")
        self.world, self.results = world, ctx.Queue()
        # One file rendezvous per run: a TCP port picked now and bound minutes later (the runs go in turn)
        # could be taken meanwhile by another process (seen: EADDRINUSE under a busy machine).
        self._dir = tempfile.TemporaryDirectory(prefix="ds-rendezvous-")
        rendezvous = [f"file://{self._dir.name}/run-{i}" for i in range(len(runs))]
        self.procs = [ctx.Process(target=run_rank, args=(r, world, rendezvous, runs, self.results, jobs_module),
                                  daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def wait(self, timeout_s: float = 120.0) -> dict[int, list]:
        """Payloads per rank (one per run), or AssertionError with every failing rank's traceback.

        The processes are always reaped."""
        out, errors = {}, []
        try:
            deadline = time.monotonic() + timeout_s
            while len(out) + len(errors) < self.world:
                rank, status, payload = self.results.get(timeout=max(1.0, deadline - time.monotonic()))
                if status == "ok":
                    out[rank] = payload
                else:
                    errors.append(f"rank {rank}: {payload}")
        finally:
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
            self._dir.cleanup()
        if errors:
            raise AssertionError("\n".join(errors))
        return out


def spawn_ranks(world: int, runs: list[dict], timeout_s: float = 120.0) -> dict[int, list]:
    return Ranks(world, runs).wait(timeout_s)


def max_abs_diff(a, b) -> int:
    import numpy as np

    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def image_mismatches(payloads: dict[int, dict], references: dict, kind: str, tol: int = 2) -> list[str]:
    """Every (rank, scenario) whose image differs from the single-rank reference by more than ``tol``."""
    bad = []
    for rank, payload in sorted(payloads.items()):
        got = payload[kind]
        if sorted(got) != sorted(references):
            bad.append(f"rank {rank}: scenarios {sorted(got)} != {sorted(references)}")
            continue
        for name, ref in references.items():
            if (diff := max_abs_diff(got[name], ref)) > tol:
                bad.append(f"rank {rank} {kind} {name}: max |diff| = {diff} > {tol}")
    return bad
