"""User reward functions for the tests (`reward.type: function`, `tests.rewards_fixture:NAME`)."""

from __future__ import annotations

import time


def length_reward(response, reference) -> float:
    return float(len(response))


def flaky(response, reference) -> float:
    """Raises, hangs or returns NaN depending on the response; else 1.0 for a response that equals the reference."""
    text = response if isinstance(response, str) else " ".join(map(str, response))
    if "raise" in text:
        raise RuntimeError("the reward exploded")
    if "hang" in text:
        time.sleep(3600)
    if "nan" in text:
        return float("nan")
    if "none" in text:
        return None  # type: ignore[return-value]
    return 1.0 if response == reference else 0.0
