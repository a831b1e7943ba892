"""Part 1: a rank of an ``mp`` engine, forked from the executor's fork server, initialises the device and answers.

The fork server imports torch and diffusers once and never touches CUDA, so the ranks it forks may initialise
it (a process forked after CUDA is initialised cannot). One engine with ``worker_start_method: forkserver``
(world 1: one GPU), one request; the rank's ``worker_info`` must name the device and the image must equal the
in-process runner's within 1 uint8. If the fork server fails, the same with ``spawn``, and the report says
which start method worked and why the fork server did not.
"""

from __future__ import annotations

from gpucheck.families import CALLS, make_runner, max_diff, request, runner_images

KIND = "sd"
NEED_S = 20.0          # an engine's start: the fork server's imports, the rank's device and model, one request


def start(path: str, target, dtype: str, method: str) -> tuple[dict, object]:
    """(the rank's worker_info, its image) from a fresh ``mp`` engine started with ``method``."""
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine

    engine = DiffusionEngine.make_engine(load_config({
        "model": {"path": path, "dtype": dtype}, "device": target.device, "executor": "mp", "warmup": False,
        "worker_start_method": method, "worker_startup_timeout_s": 240.0}))
    try:
        (info,) = engine.collective_rpc("worker_info")
        out = engine.add_request(request(CALLS[KIND], f"{method}-1", seed=9)).result(timeout=240)
        return info, out.images
    finally:
        engine.close()


def run(target, clock, emit, root: str) -> None:
    from stage_runtime.models.tiny import make_tiny_model

    dtype = target.dtypes[0]
    path = str(make_tiny_model(f"{root}/forkstart-{KIND}", kind=KIND))
    runner = make_runner(path, target, dtype)
    try:
        expected = runner_images(runner, request(CALLS[KIND], "in-process", seed=9), "request")
    finally:
        runner.close()
    want = str(target.torch_device)
    why_not = None
    for method in ("forkserver", "spawn"):
        check = f"rank started by {method}: {want}"
        if clock.spent(need_s=NEED_S):
            emit(check, "budget", "", clock.reason())
            return
        try:
            info, images = start(path, target, dtype, method)
        except Exception as exc:  # noqa: BLE001 - the reason is the finding; then the fallback is tried
            why_not = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            emit(check, "FAIL", "did not start", why_not, method=method, error=why_not)
            continue
        diff = max_diff(images, expected)
        ok = info["device"] == want and diff <= 1
        detail = f"rank pid {info['pid']} on {info['device']}" + (
            f"; fell back from forkserver: {why_not}" if why_not else "")
        emit(check, "ok" if ok else "FAIL", f"image max|diff| {diff} (<= 1)", detail, method=method,
             device=info["device"], max_diff=diff, fell_back_because=why_not)
        return
