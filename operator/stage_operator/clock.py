"""Times in status: RFC 3339 UTC strings. Seconds for conditions; milliseconds where the operator waits on
them (backoffUntil, draining), so a deadline is never rounded a second late."""

from __future__ import annotations

import datetime

_UTC = datetime.UTC


def format_time(epoch: float, *, millis: bool = False) -> str:
    moment = datetime.datetime.fromtimestamp(epoch, _UTC)
    if millis:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    """Epoch seconds of `2026-01-01T00:00:00Z` or `2026-01-01T00:00:00.250Z`; ValueError names a bad one."""
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(_UTC).timestamp()
