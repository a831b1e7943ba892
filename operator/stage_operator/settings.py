"""The operator's own settings (kopf's are `kopf.OperatorSettings`): built once from the command line by
`python -m stage_operator` and handed to the handlers through kopf's memo (`memo.config`); nothing travels
through environment variables."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_RESYNC_SECONDS = 30.0


@dataclass(frozen=True)
class OperatorSettings:
    resync_seconds: float = DEFAULT_RESYNC_SECONDS  # re-reconcile every stage this often, events or not

    def __post_init__(self) -> None:
        if not self.resync_seconds > 0:
            raise ValueError(f"resync_seconds must be > 0, got {self.resync_seconds!r}")
