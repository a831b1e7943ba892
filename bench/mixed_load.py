"""Mixed long/short load over HTTP: diffstage's scheduling policies against a plain one-lock server.

The workload: ``--requests`` requests with seeded Poisson arrivals at ``--rate`` per second, a fraction
``--long-fraction`` of them ``--long-steps`` steps ("long"), the rest ``--short-steps`` ("short"), all
``--size`` px, tiny SD. Each run draws one arrival trace (seed + run) and replays it against every server,
the order rotated per run (interleaved), so the per-run ratios compare the same trace.

Servers, all on loopback, all started here, one torch thread each (``--threads``):
  plain          what a user writes in an afternoon: aiohttp + ``DiffusionPipeline`` + one ``asyncio.Lock``
                 around a whole pipeline call (PNG + base64 in JSON, as the images API answers)
  step-<policy>  ``stage-runtime serve`` in step mode, ``--max-num-seqs`` slots, ``--scheduling-policy``
                 policy; with ``priority`` the short requests are sent with priority 1
  request-fcfs   request mode (whole pipeline calls per wave) for reference

Prints makespan (first send → last answer) and per-class p50/p99 latency (median and min–max over runs),
the per-run ratios to the plain server, and the machine with its load average.

    .venv/bin/python bench/mixed_load.py [--runs 3] [--requests 24] [--rate 4] [--servers plain,step-srpt,...]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import machine, pair_ratios, spread  # noqa: E402

DEFAULT_SERVERS = "plain,step-fcfs,step-priority,step-srpt"


# -- the plain server (this file run with --plain-server) -------------------------------------------------
def plain_server(model: str, port: int, threads: int) -> None:
    import torch
    from aiohttp import web
    from diffusers import DiffusionPipeline

    torch.set_num_threads(threads)
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    lock = asyncio.Lock()

    def run(body: dict) -> list[str]:
        with torch.inference_mode():
            images = pipe(body["prompt"], num_inference_steps=body["num_inference_steps"],
                          height=body["height"], width=body["width"],
                          generator=torch.Generator("cpu").manual_seed(body["seed"])).images
        out = []
        for image in images:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            out.append(base64.b64encode(buf.getvalue()).decode())
        return out

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        async with lock:
            data = await asyncio.get_running_loop().run_in_executor(None, run, body)
        return web.json_response({"data": [{"b64_json": b} for b in data]})

    app = web.Application()
    app.router.add_post("/generate", generate)
    print("plain server ready", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


# -- starting servers ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_log(proc: subprocess.Popen, log: Path, marker: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if marker in text:
            return text
        if proc.poll() is not None:
            raise SystemExit(f"{log.name}: exited with {proc.returncode}:\n{text[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{log.name}: not ready within {timeout:.0f} s")


def start_server(name: str, model: str, args, workdir: Path) -> tuple[subprocess.Popen, str, str]:
    """(process, base url, generation path) for one server."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = workdir / f"{name}.log"
    if name == "plain":
        port = free_port()
        cmd = [sys.executable, __file__, "--plain-server", model, "--port", str(port), "--threads", str(args.threads)]
        proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_log(proc, log, "plain server ready")
        time.sleep(0.5)
        return proc, f"http://127.0.0.1:{port}", "/generate"
    mode, policy = name.split("-", 1)
    cmd = [sys.executable, "-m", "stage_runtime", "serve", "--model", model, "--device", "cpu", "--executor", "uni",
           "--host", "127.0.0.1", "--http-port", "0", "--zmq-port", "0", "--execution-mode", mode,
           "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", "1024", "--scheduling-policy", policy]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    text = wait_log(proc, log, " ready: ")
    http = re.search(r"listening http=(\S+) zmq=(\S+)", text).group(1)
    return proc, http.rstrip("/"), "/v1/images/generations"


# -- the workload ---------------------------------------------------------------------------------------
def trace(args, run: int) -> list[tuple[float, str, int]]:
    """(arrival offset s, class, seed) per request: seeded Poisson arrivals, a long/short mix."""
    rng = random.Random(args.seed * 1000 + run)
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        out.append((t, "long" if rng.random() < args.long_fraction else "short", 1000 * run + i))
    return out


async def replay(url: str, path: str, server: str, items, args) -> tuple[float, dict[str, list[float]]]:
    import httpx

    lat: dict[str, list[float]] = {"short": [], "long": []}
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=args.requests + 4)) as client:
        start = time.perf_counter()

        async def one(offset: float, cls: str, seed: int) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            steps = args.long_steps if cls == "long" else args.short_steps
            body = {"prompt": f"a photo {seed}", "num_inference_steps": steps, "seed": seed}
            if server == "plain":
                body.update(height=args.size, width=args.size)
            else:
                body["size"] = f"{args.size}x{args.size}"
                if server.endswith("priority") and cls == "short":
                    body["priority"] = 1
            t0 = time.perf_counter()
            resp = await client.post(path, json=body)
            resp.raise_for_status()
            lat[cls].append(time.perf_counter() - t0)

        await asyncio.gather(*(one(*item) for item in items))
        return time.perf_counter() - start, lat


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of a few dozen samples is their maximum)."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100 * len(v) + 0.5)) - 1))] if v else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain-server", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--long-steps", type=int, default=40)
    ap.add_argument("--short-steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--servers", default=DEFAULT_SERVERS)
    ap.add_argument("--model", help="a diffusers SD folder (default: build the tiny one)")
    args = ap.parse_args()
    if args.plain_server:
        return plain_server(args.plain_server, args.port, args.threads)

    from stage_runtime.models.tiny import make_tiny_model

    servers = args.servers.split(",")
    if "plain" not in servers:
        raise SystemExit("--servers must include plain (the ratios are to it)")
    workdir = Path(tempfile.mkdtemp(prefix="mixed-load-"))
    model = args.model or str(make_tiny_model(workdir / "tiny-sd", kind="sd"))
    procs, endpoints = [], {}
    results: dict[str, list[tuple[float, dict[str, list[float]]]]] = {s: [] for s in servers}
    try:
        for name in servers:
            proc, url, path = start_server(name, model, args, workdir)
            procs.append(proc)
            endpoints[name] = (url, path)
        warm = [(0.0, "short", 1), (0.0, "long", 2)]
        for name in servers:
            asyncio.run(replay(*endpoints[name], name, warm, args))
        for run in range(args.runs):
            items = trace(args, run)
            order = servers[run % len(servers):] + servers[:run % len(servers)]
            for name in order:
                results[name].append(asyncio.run(replay(*endpoints[name], name, items, args)))
                print(f"run {run + 1}/{args.runs} {name}: makespan {results[name][-1][0]:.2f} s", flush=True)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()

    def metric(name: str, what: str) -> list[float]:
        if what == "makespan":
            return [m for m, _ in results[name]]
        cls, q = what.split("_p")
        return [pct(lat[cls], float(q)) for _, lat in results[name]]

    print(f"\nran on: {machine()}")
    n_long = [len(lat["long"]) for _, lat in results["plain"]]
    print(f"workload: {args.requests} requests, Poisson {args.rate}/s (seed {args.seed}+run), long {args.long_steps} "
          f"steps (per run {n_long}), short {args.short_steps} steps, {args.size}px tiny SD, "
          f"max_num_seqs {args.max_num_seqs}, {args.threads} torch thread per server, {args.runs} runs interleaved")
    for what in ("makespan", "short_p50", "short_p99", "long_p50", "long_p99"):
        print(f"\n{what} (s):")
        for name in servers:
            line = f"  {name:14s} {spread(metric(name, what), 's', 1, 3)}"
            if name != "plain":
                ratios = pair_ratios(metric(name, what), metric("plain", what))
                line += (f"   ratio to plain median {statistics.median(ratios):.2f} "
                         f"(min {min(ratios):.2f} – max {max(ratios):.2f})")
            print(line)


if __name__ == "__main__":
    main()
