"""Helpers shared by the store backends: argument checks, polling with backoff, key names."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from trainingrun.store.base import RankPayload, StoreTimeout
from trainingrun.store.wire import check_payload

KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_key(key: str) -> str:
    """Keys of put_json/get_json: 1-128 characters of [A-Za-z0-9_.-], not starting with '.' or '-'."""
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise ValueError(f"key: must be 1-128 characters of [A-Za-z0-9_.-] starting with a letter or digit, got {key!r}")
    return key


def check_rollout(rollout: int, name: str = "rollout") -> int:
    if isinstance(rollout, bool) or not isinstance(rollout, int) or rollout < 0:
        raise ValueError(f"{name}: must be an int >= 0, got {rollout!r}")
    return rollout


def check_publish(rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any]) -> int:
    """Validate a publish_rollout call; return dp_size. ValueError names the field."""
    check_rollout(rollout)
    if not isinstance(schedule, dict):
        raise ValueError(f"schedule: must be a dict, got {type(schedule).__name__}")
    dp = schedule.get("dp_size")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"schedule.dp_size: must be an int >= 1, got {dp!r}")
    if schedule.get("rollout", rollout) != rollout:
        raise ValueError(f"schedule.rollout: {schedule.get('rollout')!r} != rollout {rollout}")
    if sorted(payloads) != list(range(dp)):
        raise ValueError(f"payloads: must have exactly the ranks 0..{dp - 1} (schedule.dp_size), got {sorted(payloads)}")
    for rank, payload in payloads.items():
        check_payload(payload, where=f"payloads[{rank}]")
    return dp


def backoff(initial: float = 0.01, maximum: float = 0.25, factor: float = 1.5) -> Iterator[float]:
    """Sleep intervals: initial, ×factor each time, capped at maximum."""
    delay = initial
    while True:
        yield delay
        delay = min(delay * factor, maximum)


def poll(check: Callable[[], Any], timeout: float | None, what: str, *, max_interval: float = 0.25) -> Any:
    """Call `check()` until it returns something other than None; StoreTimeout naming `what` after `timeout` s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for delay in backoff(maximum=max_interval):
        result = check()
        if result is not None:
            return result
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"timed out after {timeout:g} s waiting for {what}")
            delay = min(delay, left)
        time.sleep(delay)
    raise AssertionError("unreachable")
