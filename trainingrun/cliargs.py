"""Argument types shared by the `trainingrun` sub-commands: numbers that must be finite and in range.

`float("nan")`, `float("inf")` and `float("1e309")` are all floats to argparse's `type=float`; a NaN grace period or
an infinite poll interval then surfaces much later as a hang or a traceback. These types refuse them on the command
line, naming the option (argparse adds it) and what is allowed.
"""

from __future__ import annotations

import argparse
import math

MAX_SECONDS = 1e9  # ~31 years: any longer "timeout" is a typo


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number (allowed: seconds, 0 <= S <= {MAX_SECONDS:g})")
    return value


def seconds(text: str) -> float:
    """A duration in seconds: finite, 0 <= S <= 1e9."""
    value = _number(text)
    if not 0 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range (allowed: seconds, 0 <= S <= {MAX_SECONDS:g})")
    return value


def positive_seconds(text: str) -> float:
    """A duration in seconds that must be more than zero: finite, 0 < S <= 1e9."""
    value = _number(text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range (allowed: seconds, 0 < S <= {MAX_SECONDS:g})")
    return value
