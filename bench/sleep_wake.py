"""Sleep and wake of a real stage (docs/sleep-and-profile.md): the tiny SD served on two CPU ranks (CFG parallel),
``--enable-sleep-mode``, each run a fresh stage process.

Per run:

    cold_start_s        ``serve`` launched → ``/ready`` (imports, both ranks loading, the warm-up request)
    freed_ratio         per rank: (RSS before − RSS asleep) ÷ the rank's weight bytes (``/v1/stats.weights``), level 2
    wake_s              ``POST /wake_up`` after level 2 (every rank reads its weights again from the folder)
    wake_vs_cold        wake_s ÷ cold_start_s of the same stage
    bitwise_equal       the first image after the wake equals the one before the sleep (same seed)
    level1_wake_s       the same for level 1 (on a CPU stage nothing moves: the weights already live in host memory)

    .venv/bin/python bench/sleep_wake.py [--runs 3] [--json] [--model tiny-sd folder]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.stats import machine  # noqa: E402


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def image(http: httpx.Client) -> np.ndarray:
    from PIL import Image

    resp = http.post("/v1/images/generations", json={"prompt": "a cat", "seed": 7, "size": "64x64",
                                                     "num_inference_steps": 4})
    resp.raise_for_status()
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(resp.json()["data"][0]["b64_json"]))))


LISTENING = re.compile(r"listening http=(\S+) zmq=(\S+)")


def start_stage(model: str, log: Path) -> tuple[subprocess.Popen, str, float]:
    """``serve`` launched and ready: (the process, its URL, seconds from launch to ``/ready``)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "stage_runtime", "serve", "--model", model, "--device", "cpu",
                             "--executor", "mp", "--cfg-parallel-size", "2", "--enable-sleep-mode", "--host",
                             "127.0.0.1", "--http-port", "0", "--zmq-port", "0"],
                            cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the stage exited {proc.returncode}: {log.read_text()[-2000:]}")
        if url is None:
            match = LISTENING.search(log.read_text(errors="replace"))
            url = match.group(1) if match else None
        elif httpx.get(f"{url}/ready", timeout=5).status_code == 200:
            return proc, url, time.monotonic() - started
        time.sleep(0.05)


def one_run(model: str, folder: Path, index: int) -> dict:
    proc, url, cold = start_stage(model, folder / f"stage{index}.log")
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            before = image(http)
            stats = http.get("/v1/stats").json()
            pids = {w["rank"]: w["pid"] for w in stats["workers"]}
            weights = dict(enumerate(stats["weights"]["rank_bytes"]))
            rss_awake = {r: rss_bytes(pid) for r, pid in pids.items()}
            http.post("/sleep", params={"level": 2}).raise_for_status()
            rss_asleep = {r: rss_bytes(pid) for r, pid in pids.items()}
            t0 = time.monotonic()
            http.post("/wake_up").raise_for_status()
            wake = time.monotonic() - t0
            after = image(http)
            http.post("/sleep", params={"level": 1}).raise_for_status()
            t0 = time.monotonic()
            http.post("/wake_up").raise_for_status()
            wake_1 = time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(60)
    freed = {r: (rss_awake[r] - rss_asleep[r]) / weights[r] for r in pids}
    return {"cold_start_s": round(cold, 3), "weight_bytes": weights, "rss_awake": rss_awake, "rss_asleep": rss_asleep,
            "freed_ratio": {r: round(v, 3) for r, v in freed.items()}, "wake_s": round(wake, 3),
            "wake_vs_cold": round(wake / cold, 4), "bitwise_equal": bool(np.array_equal(before, after)),
            "level1_wake_s": round(wake_1, 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", default="tiny-sd")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="diffstage-sleep-bench-") as tmp:
        runs = [one_run(args.model, Path(tmp), i) for i in range(args.runs)]
    report = {"runs": runs, "machine": machine()}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"sleep/wake, tiny SD on 2 CPU ranks (CFG parallel), {args.runs} runs; {machine()}")
    for i, r in enumerate(runs):
        print(f"  run {i + 1}: cold start {r['cold_start_s']:.2f} s, level-2 wake {r['wake_s']:.2f} s "
              f"({r['wake_vs_cold']:.3f} of cold), freed per rank {r['freed_ratio']} of the weights, "
              f"bitwise {r['bitwise_equal']}, level-1 wake {r['level1_wake_s']:.3f} s")
    ratios = [r["wake_vs_cold"] for r in runs]
    print(f"  wake ÷ cold: median {statistics.median(ratios):.3f} (min {min(ratios):.3f} – max {max(ratios):.3f}, "
          f"n={len(ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
