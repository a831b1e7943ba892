"""What the operator's probes saw of each pod, kept per pod uid (a recreated pod starts afresh).

`PodHealth` is plain data the pure reconcile reads; `HealthBook` folds one probe result after another into
it (consecutive failures) and is owned by the operator process (memory: an operator restart starts over,
which only delays a verdict by a few probe periods)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeResult:
    """One probe of one pod: `/health` and `/v1/stats`. `dead` is the 503 reason; `error` a failure to answer."""

    at: float
    dead: str | None = None
    error: str | None = None
    state: str | None = None
    waiting: int | None = None
    running: int | None = None
    startup: dict | None = None  # /v1/stats.startup: {phase, phases: {name: seconds}, model_bytes}
    loras: tuple[str, ...] | None = None  # names from /v1/loras (None: not asked or not answered)
    jobs: dict | None = None  # /v1/stats.jobs: {here, queued, in_progress, completed, failed} (a stage with a store)
    cost: int | None = None  # /v1/stats.cost.outstanding: the pixel-steps left in flight (None: an older stage)
    compile: dict | None = None  # /v1/stats.compile: {mode, mode_effective, reason, graphs, …} (spec.compile on)
    sleep: dict | None = None  # /v1/stats.sleep: {is_sleeping, level, sleeps_total, wakes_total} (spec.sleep on)


@dataclass(frozen=True)
class PodHealth:
    health: str  # Healthy | Unhealthy (/health 503) | Unreachable (no answer)
    checked_at: float
    failures: int = 0  # consecutive probes without an answer
    answered: bool = False  # the pod answered at least once (so a stage still starting is never failed)
    reason: str = ""
    state: str | None = None
    waiting: int | None = None
    running: int | None = None
    startup: dict | None = None  # what the stage said of its startup (phase while loading, durations after)
    loras: tuple[str, ...] | None = None  # the LoRA adapters the stage has loaded (its /v1/loras)
    jobs: dict | None = None  # the video jobs it runs (here) and the store's by status, at its last scan
    cost: int | None = None  # outstanding pixel-steps (remaining steps x pixels x frames x outputs in flight)
    compile: dict | None = None  # what the stage said of its compiled denoiser (stage_http.compile_report's keys)
    sleep: dict | None = None  # whether it sleeps, at its last answer (stage_http.sleep_report's keys)

    @property
    def sleeping(self) -> bool:
        """Asleep at its last answer: still Ready and in the Service (a request wakes it), never a failure."""
        return bool((self.sleep or {}).get("is_sleeping"))

    @property
    def jobs_here(self) -> int:
        """The video jobs the pod runs: they hand off to another replica when it stops (SIGTERM), so a drain need
        not wait for them."""
        return int((self.jobs or {}).get("here") or 0)

    @property
    def loading_phase(self) -> str | None:
        return (self.startup or {}).get("phase") if self.state == "starting" else None

    @property
    def in_flight(self) -> int | None:
        return None if self.waiting is None or self.running is None else self.waiting + self.running

    def failed(self, threshold: int, ready: bool) -> str | None:
        """Why this pod counts as failed, or None: /health 503 at once; `threshold` probes in a row without
        an answer once it has answered (or the kubelet called it ready) before."""
        if self.health == "Unhealthy":
            return self.reason
        if self.failures >= threshold and (self.answered or ready):
            return f"no answer to {self.failures} consecutive probes: {self.reason}"
        return None


class HealthBook:
    def __init__(self) -> None:
        self._pods: dict[str, PodHealth] = {}

    def record(self, uid: str, result: ProbeResult) -> tuple[PodHealth, bool]:
        """The pod's new health and whether anything the status shows changed."""
        old = self._pods.get(uid)
        if result.error is not None:
            failures = (old.failures if old else 0) + 1
            new = PodHealth("Unreachable", result.at, failures, bool(old and old.answered), result.error,
                            compile=old.compile if old else None,  # what it compiled at warm-up still holds
                            sleep=old.sleep if old else None)  # one missed answer does not wake it
        else:
            new = PodHealth("Unhealthy" if result.dead else "Healthy", result.at, 0, True, result.dead or "",
                            result.state, result.waiting, result.running,
                            result.startup if result.startup is not None else (old.startup if old else None),
                            result.loras if result.loras is not None else (old.loras if old else None),
                            result.jobs, result.cost,
                            result.compile if result.compile is not None else (old.compile if old else None),
                            result.sleep)
        self._pods[uid] = new
        shown = ("health", "failures", "waiting", "running", "state", "loading_phase", "loras", "jobs", "compile",
                 "sleeping")
        changed = old is None or any(getattr(old, k) != getattr(new, k) for k in shown)
        return new, changed

    def snapshot(self, uids: set[str] | None = None) -> dict[str, PodHealth]:
        return {u: h for u, h in self._pods.items() if uids is None or u in uids}

    def forget_except(self, uids: set[str]) -> None:
        """Drop pods that are gone (bounded memory)."""
        for uid in set(self._pods) - uids:
            del self._pods[uid]
