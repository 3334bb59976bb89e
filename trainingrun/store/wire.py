"""Wire format of the store: JSON for schedules and metadata, a small own binary format for rank payloads.

No pickle anywhere: a payload is a fixed magic, a JSON header and raw little-endian numpy buffers, decoded with
`np.frombuffer` only. Anything else (a pickle, a truncated write, flipped bits) raises `CorruptPayload`.

Payload layout (all integers little-endian):

    offset 0   8 bytes   magic  b"TRPAYLD1"
    offset 8   4 bytes   uint32 header length H
    offset 12  H bytes   JSON header, UTF-8:
                         {"fields": [{"name", "dtype", "shape", "offset", "nbytes", "checksum"}, ...]}
                         `offset` counts from the start of the data section
    then       pad to a multiple of 64 bytes (the data section starts 64-byte aligned)
    data       the raw buffers, each starting at a multiple of 64 bytes

Each buffer's checksum is checked on decode (see `checksum`: block sums of 64-bit words, then CRC-32 of those sums;
it runs at memory speed, where a plain CRC-32 would cost more than reading the bytes from the page cache). After
decoding, the payload's shape invariants (`check_payload`) are checked too, so a reader gets either a well-formed
`RankPayload` or `CorruptPayload`.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np

from trainingrun.store.base import PAYLOAD_FIELDS, CorruptPayload, RankPayload

MAGIC = b"TRPAYLD1"
ALIGN = 64
_HEADER_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20


CHECKSUM_BLOCK = 4096  # 64-bit words per block (32 KiB)


def _pad(n: int) -> int:
    return (-n) % ALIGN


def checksum(buf: memoryview | bytes) -> int:
    """Checksum of a buffer: the sums (mod 2**64) of each block of 4096 little-endian 64-bit words (the last partial
    word zero-padded), then the CRC-32 of those block sums. Any single flipped bit changes its block's sum; a moved
    block changes the CRC. Not cryptographic: it detects damage, not tampering (the format is never executable)."""
    view = memoryview(buf).cast("B")
    n8 = len(view) // 8 * 8
    words = np.frombuffer(view[:n8], dtype="<u8")
    blocks = len(words) // CHECKSUM_BLOCK
    sums = words[: blocks * CHECKSUM_BLOCK].reshape(blocks, CHECKSUM_BLOCK).sum(axis=1, dtype=np.uint64)
    rest = words[blocks * CHECKSUM_BLOCK :].sum(dtype=np.uint64)
    if n8 < len(view):
        rest = rest + np.frombuffer(bytes(view[n8:]) + b"\0" * (8 - (len(view) - n8)), dtype="<u8")[0]
    return zlib.crc32(np.append(sums, np.uint64(rest)).astype("<u8").tobytes())


def check_payload(payload: RankPayload, *, where: str = "payload") -> None:
    """Raise ValueError naming the field if `payload` is not a well-formed RankPayload.

    Fields and dtypes: `base.PAYLOAD_FIELDS`, all 1-D. With n samples and T tokens: offsets has n + 1 entries, starts
    at 0, never decreases and ends at T; loss_mask has T entries (0 or 1); advantages, rewards, sample_ids have n.
    """
    if not isinstance(payload, dict):
        raise ValueError(f"{where}: must be a dict of numpy arrays, got {type(payload).__name__}")
    missing = sorted(set(PAYLOAD_FIELDS) - set(payload))
    extra = sorted(set(payload) - set(PAYLOAD_FIELDS))
    if missing or extra:
        raise ValueError(
            f"{where}: fields must be exactly {sorted(PAYLOAD_FIELDS)}; missing {missing}, unexpected {extra}"
        )
    for name, dtype in PAYLOAD_FIELDS.items():
        arr = payload[name]
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"{where}.{name}: must be a numpy array, got {type(arr).__name__}")
        if arr.dtype != dtype:
            raise ValueError(f"{where}.{name}: dtype must be {dtype}, got {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"{where}.{name}: must be 1-D, got shape {arr.shape}")
    offsets = payload["offsets"]
    n = len(offsets) - 1
    total = len(payload["tokens"])
    if n < 0:
        raise ValueError(f"{where}.offsets: needs at least one entry (n + 1 for n samples)")
    if offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(
            f"{where}.offsets: must start at 0 and end at len(tokens)={total}, got {offsets[0]}..{offsets[-1]}"
        )
    if n and np.any(np.diff(offsets) < 0):
        raise ValueError(f"{where}.offsets: must not decrease")
    if len(payload["loss_mask"]) != total:
        raise ValueError(f"{where}.loss_mask: length {len(payload['loss_mask'])} != len(tokens)={total}")
    if total and payload["loss_mask"].max(initial=0) > 1:
        raise ValueError(f"{where}.loss_mask: values must be 0 or 1")
    for name in ("advantages", "rewards", "sample_ids"):
        if len(payload[name]) != n:
            raise ValueError(f"{where}.{name}: length {len(payload[name])} != number of samples {n}")


def encode_payload_parts(payload: RankPayload) -> list[memoryview | bytes]:
    """The encoded payload as a list of byte chunks (no copy of the array data); `b"".join` gives the bytes."""
    check_payload(payload)
    fields = []
    offset = 0
    buffers = []
    for name in PAYLOAD_FIELDS:
        arr = np.ascontiguousarray(payload[name]).astype(PAYLOAD_FIELDS[name].newbyteorder("<"), copy=False)
        view = memoryview(arr).cast("B")
        fields.append(
            {
                "name": name,
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "offset": offset,
                "nbytes": arr.nbytes,
                "checksum": checksum(view),
            }
        )
        buffers.append(view)
        offset += arr.nbytes + _pad(arr.nbytes)
    header = json.dumps({"fields": fields}, separators=(",", ":")).encode()
    prefix = MAGIC + _HEADER_LEN.pack(len(header)) + header
    parts: list[memoryview | bytes] = [prefix + b"\0" * _pad(len(prefix))]
    for view in buffers:
        parts.append(view)
        if _pad(len(view)):
            parts.append(b"\0" * _pad(len(view)))
    return parts


def encode_payload(payload: RankPayload) -> bytes:
    """The payload as one bytes object."""
    return b"".join(encode_payload_parts(payload))


def decode_payload(data: bytes | bytearray | memoryview, *, where: str) -> RankPayload:
    """Decode bytes written by `encode_payload`; `where` (store URL and key) goes into every error message.

    The arrays are views of `data` (no copy); they are read-only when `data` is `bytes`.
    """
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    if len(buf) < len(MAGIC) + _HEADER_LEN.size or bytes(buf[: len(MAGIC)]) != MAGIC:
        head = bytes(buf[:8])
        hint = " (looks like a pickle: refused, the store never unpickles)" if head[:1] == b"\x80" else ""
        raise CorruptPayload(f"{where}: not a trainingrun payload: bad magic {head!r}{hint}")
    (hlen,) = _HEADER_LEN.unpack_from(buf, len(MAGIC))
    hstart = len(MAGIC) + _HEADER_LEN.size
    if hlen > MAX_HEADER_BYTES or hstart + hlen > len(buf):
        raise CorruptPayload(f"{where}: payload header length {hlen} exceeds the {len(buf)} bytes stored")
    try:
        header = json.loads(bytes(buf[hstart : hstart + hlen]))
        fields = {f["name"]: f for f in header["fields"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptPayload(f"{where}: payload header is not valid JSON of the expected shape: {exc}") from None
    data_start = hstart + hlen + _pad(hstart + hlen)
    out: RankPayload = {}
    for name, dtype in PAYLOAD_FIELDS.items():
        f = fields.get(name)
        if f is None:
            raise CorruptPayload(f"{where}: payload lacks field {name!r}")
        try:
            got = np.dtype(f["dtype"])
            shape = tuple(int(s) for s in f["shape"])
            start = data_start + int(f["offset"])
            nbytes = int(f["nbytes"])
            crc = int(f["checksum"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptPayload(f"{where}: payload field {name!r} has a bad header entry: {exc}") from None
        if got != dtype.newbyteorder("<") or len(shape) != 1 or shape[0] * dtype.itemsize != nbytes:
            raise CorruptPayload(f"{where}: payload field {name!r}: header says {got}{list(shape)} / {nbytes} bytes")
        if start < data_start or start + nbytes > len(buf):
            raise CorruptPayload(
                f"{where}: payload field {name!r} spans bytes {start}..{start + nbytes} but only {len(buf)} are stored"
                " (truncated write?)"
            )
        view = buf[start : start + nbytes]
        if checksum(view) != crc:
            raise CorruptPayload(f"{where}: payload field {name!r} fails its checksum (corrupted bytes)")
        out[name] = np.frombuffer(view, dtype=got)
    try:
        check_payload(out, where=where)
    except ValueError as exc:
        raise CorruptPayload(f"inconsistent payload: {exc}") from None
    return out


def payload_nbytes(payload: RankPayload) -> int:
    """Bytes of the arrays (without header), for throughput figures."""
    return sum(int(a.nbytes) for a in payload.values())


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def encode_json(value: Any, *, where: str = "value") -> bytes:
    """Strict JSON (NaN/inf refused); numpy scalars and arrays become plain numbers and lists."""
    try:
        return json.dumps(value, default=_json_default, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: cannot be stored as JSON: {exc}") from None


def decode_json(data: bytes, *, where: str) -> Any:
    """Decode stored JSON; CorruptPayload (naming `where`) if it is not JSON."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptPayload(f"{where}: stored value is not valid JSON: {exc}") from None
