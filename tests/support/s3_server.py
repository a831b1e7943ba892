"""A real S3-compatible server for the object job store's tests: moto's server (``moto[server]``), started as its own
process on 127.0.0.1 at a free port — not moto's in-process mock — so every stage process of a test reaches it over
HTTP like a bucket. ``pause()`` / ``resume()`` stop and continue the process (SIGSTOP / SIGCONT): the store out of
reach, then back with everything it held. Credentials are fake; the environment variables boto3 reads are set by
``aws_environment`` for the test process and the stage processes it starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from support.waiting import wait_until

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "diffstage-test", "AWS_SECRET_ACCESS_KEY": "diffstage-test-secret",
                    "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class S3Server:
    def __init__(self, log_path: Path, cpus: set[int] | None = None):
        self.log_path, self.proc, self.cpus = log_path, None, cpus      # cpus: the cores it may run on (a bench's)
        self._client = None
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> S3Server:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **FAKE_CREDENTIALS},
                                     preexec_fn=None if self.cpus is None else lambda: os.sched_setaffinity(0, self.cpus))
        wait_until(self.answers, timeout, f"the moto S3 server answering HTTP at {self.endpoint}", poll=0.05)
        return self

    def answers(self) -> bool:
        """Whether the server answers HTTP (AssertionError with its log if the process has exited)."""
        assert self.proc.poll() is None, f"moto server exited {self.proc.returncode}: {self.log_path.read_text()}"
        try:
            return httpx.get(f"{self.endpoint}/moto-api/", timeout=1).status_code < 500
        except httpx.HTTPError:
            return False

    def client(self):
        """A plain boto3 client of the server (the tests' own hand on the bucket), made once."""
        if self._client is None:
            import boto3

            self._client = boto3.session.Session(
                aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]).client(
                "s3", endpoint_url=self.endpoint, region_name=FAKE_CREDENTIALS["AWS_DEFAULT_REGION"])
        return self._client

    def make_bucket(self, name: str) -> str:
        """A new empty bucket; its name."""
        self.client().create_bucket(Bucket=name)
        return name

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
