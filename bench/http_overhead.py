"""Per-request cost of serving over HTTP (+PNG) and ZMQ against the engine API, measured side by side.

The same requests (prompt, seed, size, steps) go, interleaved and rotating which goes first, through
  engine  ``DiffusionEngine.generate`` in this process (uint8 arrays; no serving layer at all),
  http    ``POST /v1/images/generations`` to a real ``stage-runtime serve`` process on loopback
          (PNG + base64 in JSON; the client decodes it back to arrays),
  zmq     ``StageClient.generate`` to the same stage process (raw uint8 arrays in msgpack).
Both sides run the same tiny model on the same CPU with the same thread count. The extra ms per HTTP
request is split into encode (PNG + base64 of the same images, timed here with the server's own function)
and transport (the rest: HTTP, JSON, loopback, event loop, process hop); client-side decoding is shown
on its own. Prints medians per image size and what it ran on.

    .venv/bin/python bench/http_overhead.py [--requests 30] [--steps 2] [--sizes 64,128] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def start_stage(model: str, threads: int, workdir: Path) -> tuple[subprocess.Popen, str, str]:
    log_path = workdir / "stage.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "stage_runtime", "serve", "--model", model, "--device", "cpu",
                             "--executor", "uni", "--host", "127.0.0.1", "--http-port", "0", "--zmq-port", "0"],
                            env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if " ready: " in text:
            http, zmq = re.search(r"listening http=(\S+) zmq=(\S+)", text).groups()
            return proc, http, zmq
        if proc.poll() is not None:
            raise SystemExit(f"stage exited with {proc.returncode}:\n{text[-2000:]}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("stage not ready within 180 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sizes", default="64,128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", help="a diffusers SD folder (default: build the tiny one)")
    args = ap.parse_args()

    import httpx
    import numpy as np
    import torch
    from PIL import Image

    from stage_runtime.client import StageClient
    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model
    from stage_runtime.serve.images import encode_b64_pngs

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="http-overhead-"))
    model = args.model or str(make_tiny_model(workdir / "tiny-sd", kind="sd"))
    stage, http_url, zmq_url = start_stage(model, args.threads, workdir)
    engine = DiffusionEngine.make_engine(load_config({"model": {"path": model}, "device": "cpu", "executor": "uni"}))
    http = httpx.Client(base_url=http_url, timeout=300)
    loop = asyncio.new_event_loop()
    zmq = StageClient(zmq_url)
    loop.run_until_complete(asyncio.sleep(0))
    loop.call_soon(zmq.connect)
    loop.run_until_complete(asyncio.sleep(0.05))
    decode_times: list[float] = []

    def sampling(size: int, seed: int) -> dict:
        return {"num_inference_steps": args.steps, "seed": seed, "width": size, "height": size}

    def run_engine(prompt: str, seed: int, size: int) -> np.ndarray:
        return engine.generate(prompt, **sampling(size, seed)).images

    def run_http(prompt: str, seed: int, size: int) -> np.ndarray:
        resp = http.post("/v1/images/generations", json={"prompt": prompt, "seed": seed, "size": f"{size}x{size}",
                                                         "num_inference_steps": args.steps})
        resp.raise_for_status()
        t0 = time.perf_counter()
        images = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).convert("RGB"))
                           for d in resp.json()["data"]])
        decode_times.append(time.perf_counter() - t0)
        return images

    def run_zmq(prompt: str, seed: int, size: int) -> np.ndarray:
        return loop.run_until_complete(zmq.generate(prompt, timeout=300, **sampling(size, seed))).images

    def floors(n: int = 200) -> dict[str, float]:
        """Round trips that do no engine work: the transport floor of each frontend."""
        out = {}
        for name, call in (("http /health", lambda: http.get("/health")),
                           ("zmq health", lambda: loop.run_until_complete(zmq.health()))):
            samples = []
            for _ in range(n):
                t0 = time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)
            out[name] = statistics.median(samples) * 1e3
        return out

    paths = {"engine": run_engine, "http": run_http, "zmq": run_zmq}
    results = {}
    try:
        floor = floors()
        for size in (int(s) for s in args.sizes.split(",")):
            for i in range(3):
                for fn in paths.values():
                    fn("warm", i, size)
            decode_times.clear()
            times: dict[str, list[float]] = {name: [] for name in (*paths, "encode")}
            max_diff = 0
            for i in range(args.requests):
                prompt, seed, out = f"a photo of object {i}", 1000 + i, {}
                order = list(paths.items())
                for name, fn in order[i % 3:] + order[:i % 3]:      # rotate which path goes first
                    t0 = time.perf_counter()
                    out[name] = fn(prompt, seed, size)
                    times[name].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                encode_b64_pngs(out["engine"])                      # what the stage does for the JSON body
                times["encode"].append(time.perf_counter() - t0)
                for name in ("http", "zmq"):
                    max_diff = max(max_diff, int(np.abs(out[name].astype(int) - out["engine"].astype(int)).max()))
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            med["decode"] = statistics.median(decode_times) * 1e3
            results[size] = (med, max_diff)
    finally:
        loop.run_until_complete(zmq.close())
        loop.close()
        http.close()
        engine.close()
        stage.send_signal(signal.SIGTERM)
        code = stage.wait(60)

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"ran on: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({args.threads} thread per process), "
          f"python {platform.python_version()}, loopback HTTP/ZMQ to a stage process (executor uni)")
    print("load average (1/5/15 min) at the end: {:.2f} {:.2f} {:.2f} — other work on these cores adds noise "
          "of a few ms per request".format(*os.getloadavg()))
    print(f"workload: tiny SD, {args.steps} steps, n=1, {args.requests} requests per path and size, interleaved")
    print("round trip with no engine work (transport floor): " +
          ", ".join(f"{name} {value:.2f} ms" for name, value in floor.items()))
    for size, (med, max_diff) in results.items():
        extra_http, extra_zmq = med["http"] - med["engine"], med["zmq"] - med["engine"]
        print(f"\n{size}x{size}: median per request  engine {med['engine']:.2f} ms | http {med['http']:.2f} ms | "
              f"zmq {med['zmq']:.2f} ms")
        print(f"  http extra {extra_http:+.2f} ms = encode (PNG+base64) {med['encode']:.2f} ms "
              f"+ transport {extra_http - med['encode']:+.2f} ms   (client decode, included: {med['decode']:.2f} ms)")
        print(f"  zmq  extra {extra_zmq:+.2f} ms (raw uint8 in msgpack, no encode)")
        print(f"  images equal to the engine's: max |diff| = {max_diff} (uint8)")
    print(f"\nstage exit code after SIGTERM: {code}")


if __name__ == "__main__":
    main()
