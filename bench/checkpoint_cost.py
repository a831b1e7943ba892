"""Step checkpoints: what one costs (time and bytes) and what resuming from one costs against not stopping.

Per tiny video kind (and SD for an image family) one in-process engine (uni executor, step mode, no busy-loop
thread: each ``step()`` is one tick, each ``checkpoint_request`` runs between two ticks, as the engine runs it)
measures, ``--runs`` times:

    tick            one denoising step of the request alone (the ticks between the first and the last); the first
                    tick (the prompt's encode and step 1) apart: a resume encodes from scratch too
    checkpoint      ``checkpoint_request`` after every step: the rank's own time (pack, serialize, write, fsync,
                    rename) and the RPC's wall time, and the file's bytes, split by the state's fields
    uninterrupted   the request from admission to its frames
    resumed         a request with ``resume_from`` = the checkpoint of step ``steps // 2``: from admission to its
                    frames (encode from scratch, the checkpoint laid over, the other half of the steps, decode),
                    against the uninterrupted run's ticks over the same steps and decode (``the same half``)

and whether the resumed frames equal the uninterrupted ones bitwise. Each line: median, min–max, number of
samples; what it ran on. ``--dir`` puts the files on the folder of your job store (NFS, CephFS) to measure it.

``--store fs|s3`` adds what a video job pays: a checkpoint every step taken off the step path (the engine snapshots
the state between ticks; a writer thread stores the bytes, one write in flight, a newer snapshot replacing a pending
one), the step's cost (its tick with the writes beside it, plus the snapshot) against a plain step, in pairs.

    .venv/bin/python bench/checkpoint_cost.py [--runs 3] [--steps 8] [--size 32] [--frames 9] [--kind wan]
                                              [--store fs|s3 [--s3-url s3://B/P --s3-endpoint URL] [--store-cpu N]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stats import machine, spread  # noqa: E402

KINDS = ("wan", "wan22", "sd")
SERVERS: list = []                       # the S3 servers this run started (stopped at the end)


def field_bytes(path: str) -> dict[str, int]:
    """The checkpoint's tensor bytes per top-level field of the step state (from its header alone)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    sizes = {name: end - start for name, entry in header.items() if name != "__metadata__"
             for start, end in [entry["data_offsets"]]}
    tree = json.loads(header["__metadata__"]["diffstage"])["state"]

    def names(node) -> list[str]:
        if isinstance(node, dict):
            own = [node[k] for k in ("tensor", "ndarray", "generator") if k in node]
            return own + [n for v in node.values() if isinstance(v, (dict, list)) for n in names(v)]
        if isinstance(node, list):
            return [n for v in node for n in names(v)]
        return []

    return {field: sum(sizes[n] for n in names(node)) for field, node in tree.items()}


def request(kind: str, rid: str, args, resume_from: str | None = None):
    from stage_runtime.request import DiffusionRequest, SamplingParams

    video = kind != "sd"
    side = args.size if video else max(args.size, 64)
    sampling = SamplingParams(num_inference_steps=args.steps, seed=7, height=side, width=side,
                              **({"num_frames": args.frames} if video else {}))
    return DiffusionRequest(rid, "a red car on a bridge", sampling, video=video, resume_from=resume_from)


def timed_run(engine, req, each_tick=None) -> tuple[float, list[float], object]:
    """(seconds from admission to the final output, each tick's seconds, the output)."""
    started = time.perf_counter()
    stream = engine.add_request(req)
    ticks = []
    while not stream.finished:
        t0 = time.perf_counter()
        engine.step()
        ticks.append(time.perf_counter() - t0)
        if each_tick is not None and not stream.finished:
            each_tick()
    return time.perf_counter() - started, ticks, stream.result(timeout=0)


def bench_kind(kind: str, args, root: str, folder: str) -> None:
    import numpy as np

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.models.tiny import make_tiny_model

    path = make_tiny_model(f"{root}/{kind}", kind=kind, seed=0)
    engine = DiffusionEngine(load_config({"model": {"path": str(path)}, "device": "cpu", "warmup": False,
                                          "scheduler": {"execution_mode": "step", "max_num_seqs": 1}}))
    half = args.steps // 2
    series: dict[str, list[float]] = {k: [] for k in ("tick", "first", "ckpt_rank", "ckpt_rpc", "full", "resumed",
                                                      "same_half")}
    sizes, split, equal = [], {}, True
    try:
        timed_run(engine, request(kind, "warm", args))                          # first-call costs out of the way
        for run in range(args.runs):
            ckpt = os.path.join(folder, f"{kind}-{run}.safetensors")
            at_half = os.path.join(folder, f"{kind}-{run}-half.safetensors")
            rid = f"full-{run}"

            def save() -> None:
                t0 = time.perf_counter()
                [saved] = engine.collective_rpc("checkpoint_request", (rid, ckpt))
                series["ckpt_rpc"].append(time.perf_counter() - t0)
                series["ckpt_rank"].append(saved["seconds"])
                sizes.append(saved["bytes"])
                if saved["step"] == half:
                    os.replace(ckpt, at_half)

            _, _, with_ckpt = timed_run(engine, request(kind, rid, args), save)
            full_s, ticks, full = timed_run(engine, request(kind, f"plain-{run}", args))
            series["full"].append(full_s)
            series["tick"] += ticks[1:-1]
            series["first"].append(ticks[0])
            series["same_half"].append(sum(ticks[half:]))
            resumed_s, _, resumed = timed_run(engine, request(kind, f"resumed-{run}", args, resume_from=at_half))
            series["resumed"].append(resumed_s)
            equal &= bool(np.array_equal(resumed.images, full.images) and np.array_equal(with_ckpt.images, full.images))
            split = field_bytes(at_half)
            for name in (ckpt, at_half):
                if os.path.exists(name):
                    os.unlink(name)
    finally:
        engine.close()
    shape = f"{args.size}x{args.size}x{args.frames}" if kind != "sd" else f"{max(args.size, 64)}² image"
    print(f"\n{kind} ({shape}, {args.steps} steps, {args.runs} runs)")
    print(f"  tick (one step)          {spread(series['tick'])}")
    print(f"  first tick (encode + 1)  {spread(series['first'])}")
    print(f"  checkpoint, rank         {spread(series['ckpt_rank'])}")
    print(f"  checkpoint, RPC wall     {spread(series['ckpt_rpc'])}")
    print(f"  checkpoint bytes         {spread(sizes, unit='KiB', scale=1 / 1024, digits=1)}; by field: "
          + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in split.items() if v))
    print(f"  uninterrupted            {spread(series['full'])}")
    print(f"  resumed at step {half:<3}      {spread(series['resumed'])}")
    print(f"  the same {args.steps - half} steps + decode   {spread(series['same_half'])}  "
          f"(uninterrupted ticks: the resume's own cost is the difference)")
    print(f"  resumed frames equal the uninterrupted ones bitwise: {equal}")


class OffPathWriter:
    """The job runner's writing, as a thread (jobs.checkpoint_writer's rule): one write in flight, a newer snapshot
    replacing a pending one."""

    def __init__(self, write):
        import threading

        self.write, self.pending, self.written, self.replaced = write, None, 0, 0
        self.cpu_s: list[float] = []          # the writer thread's own CPU per write (what it can take from a step)
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def submit(self, data: bytes) -> None:
        with self.cond:
            self.replaced += self.pending is not None
            self.pending = data
            self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.pending is None and not self.closed:
                    self.cond.wait()
                if self.pending is None:
                    return
                data, self.pending = self.pending, None
            started = time.thread_time()
            self.write(data)
            self.cpu_s.append(time.thread_time() - started)
            self.written += 1

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()


def open_store(args, root: str):
    """The job store the writes go to: the folder store (``--dir`` or a temp folder), or the object store."""
    if args.store == "s3":
        from stage_runtime.jobs.store.s3 import ObjectJobStore

        if args.s3_url is None:                  # a moto S3 server process on loopback (what the tests use)
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
            from support.s3_server import FAKE_CREDENTIALS, S3Server

            os.environ.update(FAKE_CREDENTIALS)
            cpus = None if args.store_cpu is None else {args.store_cpu}
            if cpus is not None:                 # the store's own CPU apart from the engine's, as on a real cluster
                os.sched_setaffinity(0, os.sched_getaffinity(0) - cpus)
            server = S3Server(__import__("pathlib").Path(root) / "moto.log", cpus).start()
            SERVERS.append(server)
            args.s3_url, args.s3_endpoint = f"s3://{server.make_bucket('checkpoint-bench')}/jobs", server.endpoint
            print(f"  (a moto S3 server on {server.endpoint}: loopback, no network between the stage and the store; "
                  + ("sharing this process's cores)" if cpus is None else f"on core {args.store_cpu}, this process on "
                     f"{sorted(os.sched_getaffinity(0))})"))
        return ObjectJobStore.from_url(args.s3_url, endpoint=args.s3_endpoint).open()
    from stage_runtime.jobs.store.filesystem import FileJobStore

    return FileJobStore(os.path.join(args.dir or root, "job-store")).open()


def bench_off_path(kind: str, args, root: str) -> None:
    """Step time with a checkpoint every step written off the step path (a snapshot between ticks, the bytes
    stored by a writer thread), against the same request without checkpoints, in alternating pairs."""
    import time as _time

    from stage_runtime.config import load_config
    from stage_runtime.engine import DiffusionEngine
    from stage_runtime.jobs.record import JobRecord, new_job_id
    from stage_runtime.jobs.store import CHECKPOINT
    from stage_runtime.models.tiny import make_tiny_model

    store = open_store(args, root)
    now = _time.time()
    record = JobRecord(id=new_job_id(now), model=kind, prompt="p", size="16x16", num_frames=9, fps=8,
                       num_steps=args.steps, created_at=now, params={"prompt": "p"})
    store.create(record)
    path = make_tiny_model(f"{root}/{kind}-off", kind=kind, seed=0)
    engine = DiffusionEngine(load_config({"model": {"path": str(path)}, "device": "cpu", "warmup": False,
                                          "scheduler": {"execution_mode": "step", "max_num_seqs": 1}}))
    ratios, plain_ticks, with_ticks, snap_s = [], [], [], []
    writer = OffPathWriter(lambda data: store.write_file(record.id, CHECKPOINT, data))
    try:
        timed_run(engine, request(kind, "warm-off", args))
        for run in range(args.runs):
            rid = f"off-{run}"

            def snapshot() -> None:
                t0 = _time.perf_counter()
                [saved] = engine.collective_rpc("checkpoint_request", (rid, None))
                snap_s.append(_time.perf_counter() - t0)
                writer.submit(saved["data"])

            _, plain, _ = timed_run(engine, request(kind, f"plain-off-{run}", args))
            before = len(snap_s)
            _, ticks, _ = timed_run(engine, request(kind, rid, args), snapshot)
            plain_ticks += plain[1:-1]
            with_ticks += ticks[1:-1]
            # a step's cost with checkpoints: its tick (the writer thread running beside it) and the snapshot
            per_step = statistics.median(ticks[1:-1]) + statistics.median(snap_s[before:])
            ratios.append(per_step / statistics.median(plain[1:-1]))
    finally:
        writer.close()
        engine.close()
        store.delete(record.id)
    overhead = [r - 1 for r in ratios]
    print(f"\n{kind}: a checkpoint every step off the step path ({args.store} store, {args.steps} steps, "
          f"{args.runs} pairs)")
    print(f"  tick (one step)          {spread(plain_ticks)}")
    print(f"  tick, writes beside it   {spread(with_ticks)}")
    print(f"  snapshot on the engine   {spread(snap_s)}  (the only part a step waits for)")
    cpu_share = [c / statistics.median(plain_ticks) for c in writer.cpu_s]
    print(f"  writer CPU per write     {spread(writer.cpu_s)}; ÷ a step: {spread(cpu_share, unit='%', scale=100)} "
          "(%: the most a write can take from a step on a shared core)")
    print(f"  step with ÷ without      overhead median {100 * sorted(overhead)[len(overhead) // 2]:+.1f} % "
          f"(min {100 * min(overhead):+.1f} – max {100 * max(overhead):+.1f} %, n={len(overhead)}); "
          f"{writer.written} writes, {writer.replaced} snapshots replaced before their write")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--kind", choices=KINDS, action="append", help="repeatable; default: all")
    parser.add_argument("--dir", help="where the checkpoints are written (default: a temp folder)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--store", choices=("fs", "s3"), help="also measure checkpoints every step written off the "
                        "step path to this job store (fs: --dir or a temp folder; s3: --s3-url and --s3-endpoint)")
    parser.add_argument("--s3-url", help="s3://BUCKET/PREFIX for --store s3 (default: a moto server started here)")
    parser.add_argument("--s3-endpoint", help="an S3-compatible server's URL for --store s3")
    parser.add_argument("--store-cpu", type=int, help="the core the moto server started here runs on (this process "
                        "then runs on the others: the store's CPU is not the stage's on a real cluster)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        folder = args.dir or root
        for kind in args.kind or KINDS:
            bench_kind(kind, args, root, folder)
            if args.store:
                bench_off_path(kind, args, root)
    for server in SERVERS:
        server.stop()
    print(f"\n{machine()}")


if __name__ == "__main__":
    main()
