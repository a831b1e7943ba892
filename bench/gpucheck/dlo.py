"""Part 2's DLO row: distributed layerwise offload on two ranks sharing the one device.

Each rank holds half of the tiny SD's UNet (``offload.mode: distributed``), the ranks all-gather every block over the
backend part 2 picked (NCCL, or gloo with CUDA tensors), and each computes a different request in the same call, as
a lock-step wave does. Both images must equal one rank without offload on the same device (request mode: within 1
uint8). The row says what each rank held: the denoiser's bytes at rest (its shards) against a full copy, where its
UNet's tensors live after the load (the device: loaded on the host, only the shards were put there), and the device
memory the rank's process had allocated at its peak while loading, at rest and at its peak while running (torch.cuda
counts a process's own allocations, so two ranks on one GPU are told apart). This proves the device handling of the gathers, not a
speedup: the ranks share one GPU.
"""

from __future__ import annotations

TOLERANCE = 1            # uint8: request mode (docs/testing.md, "Equal to diffusers")
PROMPTS = ("a red cat", "a blue dog")


def _config(path: str, offload: dict, world: int):
    from stage_runtime.config import load_config

    return load_config({"model": {"path": path}, "device": "cpu", "parallel": {"num_gpus": world},
                        "offload": offload, "executor": "uni" if world == 1 else "mp"})


def _image(runner, rid: str, prompt: str, seed: int):
    from stage_runtime.request import DiffusionRequest, SamplingParams
    from stage_runtime.scheduler_output import NewRequestData, SchedulerOutput

    request = DiffusionRequest(rid, prompt, SamplingParams(num_inference_steps=3, seed=seed, height=64, width=64))
    wave = SchedulerOutput(step_id=1, scheduled_new_reqs=[NewRequestData(rid, request.resolve(runner.model_info))])
    out = runner.execute_model(wave).get(rid)
    if out.error:
        raise RuntimeError(out.error)
    return out.images


def reference(path: str, device) -> list:
    """Each rank's request on one rank, the whole UNet on the device, no offload."""
    from stage_runtime.worker.model_runner import DiffusionModelRunner

    runner = DiffusionModelRunner(_config(path, {}, 1), device)
    runner.load_model()
    try:
        return [_image(runner, f"ref-{r}", PROMPTS[r], r + 1) for r in range(2)]
    finally:
        runner.close()


def dlo_rank(rank: int, job: dict, results) -> None:
    """A rank's body (ranks.launch's target): join a dp=2 world, load with DLO, run this rank's request."""
    import torch

    from gpucheck.ranks import rank_device
    from stage_runtime.distributed.groups import destroy_distributed, init_distributed
    from stage_runtime.worker.model_runner import DiffusionModelRunner

    torch.set_num_threads(1)
    device, config = rank_device(rank, job["placement"]), _config(job["path"], {"mode": "distributed"}, 2)
    try:
        groups = init_distributed(config.parallel, rank, job["rendezvous"], device, 90.0, backend=job["backend"])
        try:
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            runner = DiffusionModelRunner(config, device)
            runner.groups = groups
            runner.load_model()                           # on the host first: the device gets the shards only
            placed = sorted({str(p.device) for p in runner.adapter.pipe.unet.parameters()})
            if cuda:
                torch.cuda.synchronize(device)
                load_peak = torch.cuda.max_memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            at_rest = torch.cuda.memory_allocated(device) if cuda else None
            image = _image(runner, f"dlo-{rank}", PROMPTS[rank], rank + 1)
            peak = torch.cuda.max_memory_allocated(device) if cuda else None
            stats = runner.offload_stats()
            runner.close()
        finally:
            destroy_distributed()
        results.put((rank, "ok", {"image": image, "stats": stats, "at_rest": at_rest, "peak": peak, "placed": placed,
                                  "load_peak": load_peak if cuda else None}))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent; exiting releases the peer
        results.put((rank, "error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"))
        raise SystemExit(1) from None


def check(path: str, target, backend: str, clock, emit) -> None:
    """The row: two DLO ranks on the one device against one rank without offload."""
    import numpy as np

    from gpucheck.ranks import errors, launch

    name = f"DLO dp 2 on 2 ranks, one {target.device} device"
    if clock.spent(need_s=10):
        emit(name, "budget", "", clock.reason())
        return
    expected = reference(path, target.torch_device)
    target.free()
    job = {"path": path, "placement": "cpu" if target.dry else "shared", "backend": backend}
    answers = launch(2, job, max(20.0, min(90.0, clock.left())), target=dlo_rank)
    problems = errors(answers)
    if problems:
        status = "budget" if all(s == "timeout" for s, _ in answers.values()) else "FAIL"
        emit(name, status, "no images", "; ".join(problems)[:400], backend=backend, errors=problems)
        return
    diff = max(int(np.abs(answers[r][1]["image"].astype(np.int16) - expected[r].astype(np.int16)).max())
               for r in range(2))
    ranks = [answers[r][1] for r in range(2)]
    full = ranks[0]["stats"]["managed_bytes"]
    held = [r["stats"]["shard_bytes"] for r in ranks]
    memory = ("" if ranks[0]["at_rest"] is None else
              "; device allocated per rank while loading (peak) " +
              ", ".join(f"{r['load_peak'] / 2**20:.1f}" for r in ranks) + " MiB, at rest " +
              ", ".join(f"{r['at_rest'] / 2**20:.1f}" for r in ranks) + " MiB, running (peak) " +
              ", ".join(f"{r['peak'] / 2**20:.1f}" for r in ranks) + " MiB")
    on_device = all(r["placed"] == [str(target.torch_device)] for r in ranks)
    ok = (diff <= TOLERANCE and all(h <= 0.55 * full for h in held) and all(r["stats"]["gathers"] > 0 for r in ranks)
          and on_device)
    emit(name, "ok" if ok else "FAIL", f"max|diff| {diff} (<= {TOLERANCE}); UNet at rest per rank "
         f"{max(held) / full:.2f}x of a full copy",
         f"{backend}; each rank its own request; UNet {full / 2**20:.2f} MiB, shards "
         f"{', '.join(f'{h / 2**20:.2f}' for h in held)} MiB{memory}", backend=backend, max_diff=diff,
         full_bytes=full, shard_bytes=held, at_rest=[r["at_rest"] for r in ranks], peak=[r["peak"] for r in ranks],
         load_peak=[r["load_peak"] for r in ranks], placed=[r["placed"] for r in ranks],
         gathers=[r["stats"]["gathers"] for r in ranks])
