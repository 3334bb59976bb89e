"""The rules of a weight version written in parts (`WeightVersions.begin_weights` … `commit_weights`), free of I/O, the
same for both backends: part names, the owners' records, the commit's decision (every owner's record there, none
failed, every part it names stored at its size; else `IncompleteWeights` naming the owner), the parts index the
commit marker commits, and the reader's checks of that index and of the assembled arrays.

A version in parts is written by several owners (the trainer ranks that assemble buckets of the model:
`engines/store_sync.py`), each part a bucket of named arrays in the wire format (`wire.py`), and committed by one:

    part     `o<owner>-<index>`: one bucket's arrays (file: `part-<name>.bin`; Redis: the value, in pieces of at most
             64 MiB under Redis' value limit)
    record   the owner's, written after its parts: {"owner", "parts": [{"name", "nbytes", "chunks"}], "meta"} or
             {"owner", "error"}
    index    the committed document: {"meta": the committing rank's meta with every owner's joined (dict values
             united key by key: each owner's `dtypes`), "parts": [descriptors, owner by owner]}; its commit marker
             (`common.WeightsMarker`) records its CRC-32, the parts' count and their total bytes
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from trainingrun.contract.errors import CorruptPayload
from trainingrun.store.base import IncompleteWeights
from trainingrun.store.common import MAX_PARTS, WeightsMarker, check_weights, committed_json, stored_int
from trainingrun.store.wire import decode_json, encode_json

PART_RE = re.compile(r"o([0-9]{4,7})-[0-9]{6,7}")


def part_name(owner: int, index: int) -> str:
    """The name of part `index` of `owner` (`o0001-000003`): the file store's file name, the Redis key's tail."""
    return f"o{owner:04d}-{index:06d}"


def check_part(version: int, owner: int, index: int, arrays: dict) -> None:
    """Validate a write_weights_part call. ValueError names the field."""
    check_weights(version, arrays, {})
    for name, value in (("owner", owner), ("index", index)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_PARTS:
            raise ValueError(f"{name}: must be an int in [0, {MAX_PARTS}), got {value!r}")


def owner_record(version: int, owner: int, parts: list[dict[str, Any]] | None, meta: dict[str, Any] | None,
                 error: str | None) -> bytes:
    """The bytes of `owner`'s record of `version` (`write_weights_owner`): its parts and meta, or its error."""
    check_part(version, owner, 0, {"-": np.zeros(0)})
    if error is not None:
        return encode_json({"owner": owner, "error": str(error)[:4000]})
    if not isinstance(meta or {}, dict) or not isinstance(parts or [], list):
        raise ValueError("write_weights_owner: parts must be a list of descriptors and meta a dict")
    return encode_json({"owner": owner, "parts": list(parts or []), "meta": dict(meta or {})}, where="owner meta")


def incomplete(url: str, version: int, owner: int, what: str) -> IncompleteWeights:
    return IncompleteWeights(f"store {url}: weight version {version} not committed: trainer owner {owner} {what}; "
                             "nothing was committed (its parts were removed)", owner=owner)


def _descriptor(p: Any, *, owner: int | None, where: str) -> dict[str, Any]:
    """A part's descriptor {"name", "nbytes", "chunks"} checked (of `owner` when given); CorruptPayload otherwise."""
    match = PART_RE.fullmatch(p.get("name", "")) if isinstance(p, dict) and isinstance(p.get("name"), str) else None
    if match is None or set(p) != {"name", "nbytes", "chunks"} or (owner is not None and int(match[1]) != owner):
        raise CorruptPayload(f"{where}: malformed part descriptor {p!r:.120}")
    stored_int(p["nbytes"], where=where, field="nbytes")
    stored_int(p["chunks"], where=where, field="chunks", minimum=1, maximum=1 << 24)
    return p


def _join_meta(into: dict[str, Any], extra: Any, *, url: str, version: int, owner: int) -> None:
    """An owner's meta joined into the version's: dict values united key by key (e.g. `dtypes`), other values equal."""
    if not isinstance(extra, dict):
        raise incomplete(url, version, owner, "wrote a record whose meta is not a JSON object")
    for key, value in extra.items():
        have = into.get(key)
        if isinstance(value, dict) and isinstance(have, (dict, type(None))):
            into[key] = {**(have or {}), **value}
        elif key in into and have != value:
            raise incomplete(url, version, owner, f"recorded {key}={value!r:.60}, another said {have!r:.60}")
        else:
            into[key] = value


def parts_plan(version: int, records: list[bytes | None], meta: dict[str, Any], attempt: int | None, *, url: str,
               stored: Callable[[dict[str, Any]], int | None]) -> tuple[bytes, WeightsMarker]:
    """What commit_weights commits, from the owners' stored records (None: none there): (the parts index — the
    version's meta with every owner's joined, and the parts in owner order —, its commit marker). `stored(part)` is
    the part's stored size (None: missing). IncompleteWeights naming the first owner that failed, wrote no record,
    or lacks a part (or has it at another size)."""
    check_weights(version, {"-": np.zeros(0)}, meta)
    joined, parts = dict(meta), []
    for owner, raw in enumerate(records):
        where = f"store {url}: weight version {version}: owner {owner}'s record"
        if raw is None:
            raise incomplete(url, version, owner, "wrote no record (it failed before, or died)")
        try:
            record = decode_json(raw, where=where)
            if not isinstance(record, dict) or record.get("owner") != owner:
                raise CorruptPayload(f"{where}: not a record of owner {owner}")
            if "error" in record:
                raise incomplete(url, version, owner, f"failed: {record['error']}")
            if not isinstance(record.get("parts"), list):
                raise CorruptPayload(f"{where}: no list of parts")
            mine = [_descriptor(p, owner=owner, where=where) for p in record["parts"]]
        except CorruptPayload as exc:
            raise incomplete(url, version, owner, f"wrote a damaged record ({exc})") from None
        for p in mine:
            size = stored(p)
            if size != p["nbytes"]:
                state = "is missing" if size is None else f"has {size} bytes stored, its record says {p['nbytes']}"
                raise incomplete(url, version, owner, f"recorded part {p['name']}, which {state}")
        _join_meta(joined, record.get("meta", {}), url=url, version=version, owner=owner)
        parts.extend(mine)
    if not parts:
        raise incomplete(url, version, 0, "and every other owner wrote no part (an empty model)")
    document = encode_json({"meta": joined, "parts": parts}, where="meta")
    marker = WeightsMarker(version, attempt or 0, sum(p["nbytes"] for p in parts), 1, zlib.crc32(document),
                           parts=len(parts))
    return document, marker


def committed_parts(marker: WeightsMarker, data: bytes, *, where: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the meta, the parts' descriptors) of a version in parts from its stored index: the CRC-32 and the count of
    parts its marker records, well-formed descriptors of distinct names whose sizes add up to the marker's bytes;
    CorruptPayload naming `where` otherwise."""
    doc = committed_json(marker, data, where=where)
    meta, parts = doc.get("meta"), doc.get("parts")
    if not isinstance(meta, dict) or not isinstance(parts, list) or len(parts) != marker.parts:
        raise CorruptPayload(f"{where}: the parts index does not hold the meta and the {marker.parts} parts its "
                             "commit marker records")
    parts = [_descriptor(p, owner=None, where=where) for p in parts]
    if len({p["name"] for p in parts}) != len(parts) or sum(p["nbytes"] for p in parts) != marker.nbytes:
        raise CorruptPayload(f"{where}: the parts index repeats a part or does not add up to the marker's bytes")
    return meta, parts


def check_part_size(size: int, part: dict[str, Any], *, where: str) -> None:
    """A part's stored size must be the one the index records (checked before anything is decoded)."""
    if size != part["nbytes"]:
        raise CorruptPayload(f"{where}: {size} bytes stored, but the parts index records {part['nbytes']}")


def join_part(into: dict[str, np.ndarray], arrays: dict[str, np.ndarray], *, where: str) -> None:
    """A decoded part's arrays added to the version's; CorruptPayload when a name is in two parts."""
    repeated = set(into) & set(arrays)
    if repeated:
        raise CorruptPayload(f"{where}: array {sorted(repeated)[0]!r} is in two parts of the version")
    into.update(arrays)
