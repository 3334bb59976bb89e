"""Wire format of the store: JSON for schedules and metadata, a small own binary format for rank payloads and
weight versions (named numeric arrays of any shape).

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
`RankPayload` or `CorruptPayload`. Weight versions use the same layout with any names, numeric little-endian dtypes
(`ARRAY_DTYPE`) and N-D shapes (`encode_arrays_parts` / `decode_arrays`), checked the same way.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import zlib
from typing import Any, NamedTuple

import numpy as np

from trainingrun.contract.errors import CorruptPayload
from trainingrun.contract.fields import FIELDS, SAMPLE, TOKEN
from trainingrun.contract.payload import NOT_ROUTED, PAYLOAD_FIELDS, PAYLOAD_OPTIONAL, RankPayload

MAGIC = b"TRPAYLD1"
ALIGN = 64
_HEADER_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20
ARRAY_KINDS = "biuf"  # numeric dtypes only: bool, signed/unsigned int, float (never object)
ARRAY_DTYPE = re.compile(r"[<|][biuf][1-8]")  # dtype.str of a little-endian (or one-byte) numeric dtype
MAX_NAME = 1024  # characters of an array's name
MAX_NDIM = 32


CHECKSUM_BLOCK = 4096  # 64-bit words per block (32 KiB)


def _pad(n: int) -> int:
    return (-n) % ALIGN


def checksum(buf: memoryview | bytes) -> int:
    """Checksum of a buffer: the sums (mod 2**64) of each block of 4096 little-endian 64-bit words (the last partial
    word zero-padded), then the CRC-32 of those block sums. Any single flipped bit changes its block's sum; a moved
    block changes the CRC. Not cryptographic: it detects damage, not tampering (the format is never executable).
    One pass at memory speed over the words; a buffer shorter than a block costs a handful of operations."""
    view = memoryview(buf).cast("B")
    n8 = len(view) // 8 * 8
    words = np.frombuffer(view, dtype="<u8", count=n8 // 8)
    full = len(words) // CHECKSUM_BLOCK * CHECKSUM_BLOCK
    rest = int(np.add.reduce(words[full:], dtype=np.uint64)) if full < len(words) else 0
    if n8 < len(view):  # the last partial word, zero-padded: its little-endian value
        rest = (rest + int.from_bytes(view[n8:], "little")) % 2**64
    if not full:
        return zlib.crc32(rest.to_bytes(8, "little"))
    sums = np.empty(full // CHECKSUM_BLOCK + 1, dtype="<u8")
    np.add.reduce(words[:full].reshape(-1, CHECKSUM_BLOCK), axis=1, dtype=np.uint64, out=sums[:-1])
    sums[-1] = rest
    return zlib.crc32(sums)


def check_payload(payload: RankPayload, *, where: str = "payload") -> None:
    """Raise ValueError naming the field if `payload` is not a well-formed RankPayload.

    Fields and dtypes: `contract.payload.PAYLOAD_FIELDS` (+ `PAYLOAD_OPTIONAL`), all 1-D. With n samples and T
    tokens: offsets has n + 1 entries, starts at 0, never decreases and ends at T; a per-token field of the table
    (`contract.fields`) has T entries (T·W, W ≥ 1, with a width), a per-sample one n; loss_mask is 0 or 1,
    routed_experts ≥ -1.
    """
    if not isinstance(payload, dict):
        raise ValueError(f"{where}: must be a dict of numpy arrays, got {type(payload).__name__}")
    missing = sorted(set(PAYLOAD_FIELDS) - set(payload))
    extra = sorted(set(payload) - set(PAYLOAD_FIELDS) - set(PAYLOAD_OPTIONAL))
    if missing or extra:
        raise ValueError(
            f"{where}: fields must be exactly {sorted(PAYLOAD_FIELDS)} (optionally {sorted(PAYLOAD_OPTIONAL)}); "
            f"missing {missing}, unexpected {extra}"
        )
    for name, dtype in _payload_fields(payload).items():
        arr = payload[name]
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"{where}.{name}: must be a numpy array, got {type(arr).__name__}")
        if arr.dtype != dtype:
            raise ValueError(f"{where}.{name}: dtype must be {dtype}, got {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"{where}.{name}: must be 1-D, got shape {arr.shape}")
    _check_invariants(payload, where)


def _check_invariants(payload: RankPayload, where: str) -> None:
    """`check_payload`'s checks of the values (offsets, lengths, mask), for arrays whose fields, dtypes and 1-D
    shapes are known to be right (checked by `check_payload`, or decoded under a checked header)."""
    offsets = payload["offsets"]
    n = len(offsets) - 1
    total = len(payload["tokens"])
    if n < 0:
        raise ValueError(f"{where}.offsets: needs at least one entry (n + 1 for n samples)")
    if offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(
            f"{where}.offsets: must start at 0 and end at len(tokens)={total}, got {offsets[0]}..{offsets[-1]}"
        )
    if n and (offsets[1:] < offsets[:-1]).any():
        raise ValueError(f"{where}.offsets: must not decrease")
    for name in payload:  # lengths by the table: a value per token (or W per token) or per sample
        f = FIELDS.get(name)
        if f is None:  # offsets
            continue
        got = len(payload[name])
        if f.per == SAMPLE and got != n:
            raise ValueError(f"{where}.{name}: length {got} != number of samples {n}")
        if f.per == TOKEN and not f.width and got != total:
            raise ValueError(f"{where}.{name}: length {got} != len(tokens)={total}")
        if f.width and (total == 0 and got or total and (got == 0 or got % total)):
            raise ValueError(f"{where}.{name}: length {got} is not a positive multiple of len(tokens)={total} "
                             f"({f.width} values per token)")
    if total and payload["loss_mask"].max(initial=0) > 1:
        raise ValueError(f"{where}.loss_mask: values must be 0 or 1")
    routed = payload.get("routed_experts")
    if routed is not None and len(routed) and routed.min() < NOT_ROUTED:
        raise ValueError(f"{where}.routed_experts: expert ids must be >= 0, or {NOT_ROUTED} for none")


def _payload_fields(payload: RankPayload) -> dict[str, np.dtype]:
    """The fields of `payload` with their dtypes: the required ones, then the optional ones it has (fixed order)."""
    return {**PAYLOAD_FIELDS, **{k: v for k, v in PAYLOAD_OPTIONAL.items() if k in payload}}


def encode_arrays_parts(arrays: dict[str, np.ndarray]) -> list[memoryview | bytes]:
    """Named 1-D or N-D numeric arrays as byte chunks (no copy of the array data); `b"".join` gives the bytes."""
    fields = []
    offset = 0
    buffers = []
    for name, array in arrays.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise ValueError(f"array name: must be a string of 1-{MAX_NAME} characters, got {name!r:.80}")
        arr = np.ascontiguousarray(array)
        if arr.dtype.kind not in ARRAY_KINDS or arr.ndim > MAX_NDIM:
            raise ValueError(f"{name}: dtype {arr.dtype} cannot be stored (numeric dtypes only, at most "
                             f"{MAX_NDIM} dimensions)")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        view = memoryview(arr.reshape(-1)).cast("B")
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
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"arrays: {len(fields)} arrays need a header of {len(header)} bytes, more than the "
                         f"{MAX_HEADER_BYTES} a reader accepts")
    prefix = MAGIC + _HEADER_LEN.pack(len(header)) + header
    parts: list[memoryview | bytes] = [prefix + b"\0" * _pad(len(prefix))]
    for view in buffers:
        parts.append(view)
        if _pad(len(view)):
            parts.append(b"\0" * _pad(len(view)))
    return parts


def encode_payload_parts(payload: RankPayload) -> list[memoryview | bytes]:
    """The encoded payload as a list of byte chunks (no copy of the array data); `b"".join` gives the bytes."""
    check_payload(payload)
    return encode_arrays_parts({name: payload[name].astype(dtype, copy=False)
                                for name, dtype in _payload_fields(payload).items()})


def encode_payload(payload: RankPayload) -> bytes:
    """The payload as one bytes object."""
    return b"".join(encode_payload_parts(payload))


HEADER_PREFIX = len(MAGIC) + _HEADER_LEN.size  # bytes before the JSON header
_INT64_MAX = 2**63 - 1


def _header_int(f: dict[str, Any], key: str, name: str, where: str, maximum: int = _INT64_MAX) -> int:
    value = f.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise CorruptPayload(f"{where}: payload field {name!r}: header {key} must be an integer in [0, {maximum}], "
                             f"got {value!r:.60}")
    return value


def _is_count(value: Any) -> bool:
    """A header integer as `_header_int` accepts it (0 to 2^63 - 1, not a bool): the fast test."""
    return type(value) is int and 0 <= value <= _INT64_MAX


@functools.lru_cache(maxsize=64)
def _little(dtype: np.dtype) -> tuple[np.dtype, str]:
    """A payload field's dtype as stored (little-endian) and its header spelling."""
    le = dtype.newbyteorder("<")
    return le, le.str


Spec = tuple[dict[str, np.dtype], dict[str, np.dtype]]  # (required fields, optional fields) with their dtypes
PAYLOAD_SPEC: Spec = (PAYLOAD_FIELDS, PAYLOAD_OPTIONAL)


class Header(NamedTuple):
    """A checked payload header: the fields by name (in buffer order), where the data section starts, total size."""

    fields: dict[str, dict[str, Any]]
    data_start: int
    total: int


def parse_header(prefix: bytes | memoryview, *, where: str, spec: Spec | None = PAYLOAD_SPEC) -> Header:
    """(fields by name, start of the data section, total size) from the first bytes of a payload: the magic, the
    header length and the JSON header (`header_span(prefix)` says how many bytes that takes). Every header value is
    checked (types, ranges, 64-byte alignment, no overlaps), so the total size is known before the buffers are read:
    a file larger or smaller than its header accounts for is refused without mapping it.

    `spec` = (required, optional) fields with their dtypes, all 1-D (a rank payload, the default); None: any names,
    numeric little-endian dtypes and shapes (a weight version). Each field comes back with "dtype" as a numpy dtype
    and "shape" as a tuple."""
    buf = memoryview(prefix).cast("B")
    if len(buf) < HEADER_PREFIX or bytes(buf[: len(MAGIC)]) != MAGIC:
        head = bytes(buf[:8])
        hint = " (looks like a pickle: refused, the store never unpickles)" if head[:1] == b"\x80" else ""
        raise CorruptPayload(f"{where}: not a trainingrun payload: bad magic {head!r}{hint}")
    (hlen,) = _HEADER_LEN.unpack_from(buf, len(MAGIC))
    if hlen > MAX_HEADER_BYTES or HEADER_PREFIX + hlen > len(buf):
        raise CorruptPayload(f"{where}: payload header length {hlen} exceeds the {len(buf)} bytes stored")
    header = decode_json(bytes(buf[HEADER_PREFIX : HEADER_PREFIX + hlen]), where=f"{where}: payload header")
    entries = header.get("fields") if isinstance(header, dict) else None
    if not isinstance(entries, list) or not all(isinstance(f, dict) for f in entries):
        raise CorruptPayload(f"{where}: payload header is not of the expected shape ({{\"fields\": [...]}})")
    fields: dict[str, dict[str, Any]] = {}
    end = 0
    for f in entries:  # in the order the buffers were written
        name = f.get("name")
        known = isinstance(name, str) and (0 < len(name) <= MAX_NAME if spec is None else (
            name in spec[0] or name in spec[1]))  # a list or an object as the name: refused, not a TypeError
        if not known or name in fields:
            raise CorruptPayload(f"{where}: payload header has an unknown or repeated field {name!r:.60}")
        shape = f.get("shape")
        if spec is None:
            if not isinstance(f.get("dtype"), str) or not ARRAY_DTYPE.fullmatch(f["dtype"]) or \
                    not isinstance(shape, list) or len(shape) > MAX_NDIM:
                raise CorruptPayload(f"{where}: payload field {name!r:.60}: header says {f.get('dtype')!r:.20}"
                                     f"{shape!r:.40}, expected a little-endian numeric dtype and a shape")
            dtype = np.dtype(f["dtype"])
        else:
            dtype, dtype_str = _little(spec[0].get(name) or spec[1][name])
            if f.get("dtype") != dtype_str or not isinstance(shape, list) or len(shape) != 1:
                raise CorruptPayload(f"{where}: payload field {name!r}: header says {f.get('dtype')!r:.20}"
                                     f"{shape!r:.40}, expected {dtype_str}[n]")
        offset, nbytes, crc = f.get("offset"), f.get("nbytes"), f.get("checksum")
        if not (_is_count(offset) and _is_count(nbytes) and type(crc) is int and 0 <= crc <= 2**32 - 1
                and all(_is_count(d) for d in shape)):  # the common case in one test; the exact error below
            for d in shape:
                _header_int({"shape": d}, "shape", name, where)
            _header_int(f, "offset", name, where)
            _header_int(f, "nbytes", name, where)
            _header_int(f, "checksum", name, where, maximum=2**32 - 1)
        dims = tuple(shape)
        count = 1
        for d in dims:
            count *= d
        if count * dtype.itemsize != nbytes or offset % ALIGN or offset < end:
            raise CorruptPayload(f"{where}: payload field {name!r:.60}: header says {count} items / {nbytes} bytes at "
                                 f"offset {offset} (inconsistent)")
        end = offset + nbytes + _pad(nbytes)
        fields[name] = {**f, "dtype": dtype, "shape": dims}
    for name in spec[0] if spec is not None else ():
        if name not in fields:
            raise CorruptPayload(f"{where}: payload lacks field {name!r}")
    data_start = HEADER_PREFIX + hlen + _pad(HEADER_PREFIX + hlen)
    return Header(fields, data_start, data_start + end)


def header_span(prefix: bytes | memoryview) -> int:
    """How many leading bytes `parse_header` needs (at least HEADER_PREFIX are needed to tell)."""
    buf = memoryview(prefix).cast("B")
    if len(buf) < HEADER_PREFIX:
        return HEADER_PREFIX
    (hlen,) = _HEADER_LEN.unpack_from(buf, len(MAGIC))
    return HEADER_PREFIX + min(hlen, MAX_HEADER_BYTES + 1)


def decode_arrays(data: bytes | bytearray | memoryview, *, where: str, spec: Spec | None = None,
                  header: Header | None = None) -> dict[str, np.ndarray]:
    """Decode bytes written by `encode_arrays_parts` (views of `data`, no copy, read-only when `data` is `bytes`);
    CorruptPayload naming `where` for anything that is not exactly that (bad magic, header, dtype, size or checksum).
    `spec`: as for `parse_header` (None: any named numeric arrays). `header`: the result of `parse_header` on the
    first bytes of these same `data` with this `spec`, when the caller has it already (not parsed twice)."""
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    fields, data_start, total = header or parse_header(buf, where=where, spec=spec)
    if total != len(buf):
        raise CorruptPayload(
            f"{where}: payload is {len(buf)} bytes but its header accounts for {total}"
            + (" (truncated write?)" if len(buf) < total else " (refused: more bytes than the header describes)"))
    out: dict[str, np.ndarray] = {}
    for name, f in fields.items():
        start = data_start + f["offset"]
        view = buf[start : start + f["nbytes"]]
        if checksum(view) != f["checksum"]:
            raise CorruptPayload(f"{where}: payload field {name!r} fails its checksum (corrupted bytes)")
        out[name] = np.frombuffer(view, dtype=f["dtype"]).reshape(f["shape"])
    return out


def decode_payload(data: bytes | bytearray | memoryview, *, where: str, header: Header | None = None) -> RankPayload:
    """Decode bytes written by `encode_payload`; `where` (store URL and key) goes into every error message;
    `header` as for `decode_arrays`.

    The arrays are views of `data` (no copy); they are read-only when `data` is `bytes`.
    """
    out = decode_arrays(data, where=where, spec=PAYLOAD_SPEC, header=header)
    try:  # fields, dtypes and shapes are the header's, checked against PAYLOAD_SPEC: the values remain
        _check_invariants(out, where)
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


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed (stored JSON is strict)")


_STRICT = json.JSONDecoder(parse_constant=_no_constants)  # made once (json.loads with an option makes one a call)


def decode_json(data: bytes, *, where: str) -> Any:
    """Decode stored JSON; CorruptPayload (naming `where`) if it is not strict JSON (NaN/Infinity refused), not
    UTF-8, or nested too deeply to decode."""
    try:
        text = data.decode(json.detect_encoding(data), "surrogatepass") if isinstance(data, (bytes, bytearray)) \
            else data  # what json.loads does with bytes
        return _STRICT.decode(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptPayload(f"{where}: stored value is not valid JSON: {exc}") from None
    except RecursionError:
        raise CorruptPayload(f"{where}: stored JSON is nested too deeply to decode (damaged or hostile)") from None
