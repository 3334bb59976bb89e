"""Small JSON records under a key of the run's store (the resume point, the progress record, the rollout's state): the
key/value view of the store they are written and read through, and the field readers that refuse a malformed record.

A record's reader names the store, the key and the field when a stored record is not what its contract says
(`CorruptPayload`, exit 78): a wrong type, a negative count, a missing required field. Fields a reader does not know
are ignored, so a writer may add fields without breaking older readers.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from trainingrun.contract.errors import CorruptPayload

MAX_COUNT = 2**63 - 1  # counts are int64 wherever they are stored


class RecordStore(Protocol):
    """What a record needs of a store (`trainingrun.store` implements it): JSON objects under short keys."""

    url: str

    def put_json(self, key: str, value: dict[str, Any]) -> None: ...

    def get_json(self, key: str) -> dict[str, Any] | None: ...


def read_object(store: RecordStore, key: str) -> tuple[dict[str, Any], str] | None:
    """The JSON object under `key` and the "store URL: key K" that names it in errors; None when nothing is there."""
    d = store.get_json(key)
    if d is None:
        return None
    where = f"store {store.url}: key {key}"
    if not isinstance(d, dict):
        raise CorruptPayload(f"{where}: must be a JSON object, got {type(d).__name__}")
    return d, where


def count(d: dict[str, Any], name: str, *, where: str, required: bool = True) -> int | None:
    """Field `name` as an integer >= 0 (None when absent and not `required`); CorruptPayload naming it otherwise."""
    if name not in d:
        if required:
            raise CorruptPayload(f"{where}: {name} is missing (an integer in [0, {MAX_COUNT}])")
        return None
    value = d[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise CorruptPayload(f"{where}: {name} must be an integer in [0, {MAX_COUNT}], got {value!r:.80}")
    return value


def number(d: dict[str, Any], name: str, *, where: str, required: bool = True, minimum: float = -math.inf,
           maximum: float = math.inf) -> float | None:
    """Field `name` as a finite number in [minimum, maximum] (None when absent and not `required`); CorruptPayload
    naming it otherwise."""
    bounded = (minimum, maximum) != (-math.inf, math.inf)
    allowed = "a finite number" + (f" in [{minimum:.15g}, {maximum:.15g}]" if bounded else "")
    if name not in d:
        if required:
            raise CorruptPayload(f"{where}: {name} is missing ({allowed})")
        return None
    value = d[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        ok = ok and math.isfinite(value) and minimum <= value <= maximum
    except OverflowError:  # an integer beyond any float
        ok = False
    if not ok:
        raise CorruptPayload(f"{where}: {name} must be {allowed}, got {value!r:.80}")
    return float(value)
