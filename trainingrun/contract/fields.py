"""One table of a sample's fields (`FIELDS`): every array a sample carries from its source to the trainer's packed
micro-batch, one row each. Everything that holds or moves these arrays is derived from the table, so a new per-token
field is one row here (plus the code that fills it and the code that reads it):

  the group         `rollout.groups.SampleGroup`, a `SampleArrays`; its JSON form (`arrays_to_json`) keeps carried
                    and staged groups in the rollout's resume state
  the samples       `contract.published.Samples`, a rollout's samples in publish order (`concat` of its groups)
  the rank payload  `contract.published.rank_payload` (`SampleArrays.payload`): each field flat over the rank's
                    samples, plus `offsets`
  the wire          `PAYLOAD_FIELDS` / `PAYLOAD_OPTIONAL` (`contract.payload`), the store's encoder, decoder and
                    checks (`store.wire`), the trainers' re-schedule (`trainer.reshard`)
  the micro-batch   `trainer.batch.pack`: per-token fields packed back to back and padded with `pad`, per-sample
                    fields [n], in `MicroBatch.fields` (the loss takes its inputs from there)

Columns:
  name      the key in the payload, in the group's JSON form and in `MicroBatch.fields`
  dtype     as stored: a little-endian (or one-byte) numeric numpy dtype string
  per       "token": one value per token (or `width` values), an array per sample; "sample": one value per sample
  width     per-token fields with W values per token (W is the same for every sample of a run): the name of W, the
            key that records it in the group's JSON form; "" for one value per token
  pad       per-token fields: the value of a token that is no sample's own (per-document padding, the dummy tokens of
            an empty or length-padded micro-batch); None for per-sample fields
  required  every rank payload has it; an optional field is in a rollout's samples for all of them or none
  stage     who fills it: "source" (every source), "generator" (generated rollouts), "pipeline" (the rollout's
            advantage stage; a jsonl source may give it), "trainer" (the trainer, on its own copy: never on the wire)
  attr      the attribute of a group or a `Samples` when it is not `name` (`loss_masks`, a list of masks)

A field added from outside this module (a plug-in, a test) goes through `register_field`, which checks the row as
the table's own rows are checked (`check_row`). `SampleArrays` keeps the values by name and reads and writes them by
attribute (`g.tokens`, `samples.logprobs = ...`) or by name (`get`, `set`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

TOKEN, SAMPLE = "token", "sample"
STAGES = ("source", "generator", "pipeline", "trainer")
NOT_ROUTED = -1  # routed_experts: the generator routed this token nowhere (the trainer's router chooses)


@dataclass(frozen=True)
class Field:
    """One row of the table (see the module docstring for the columns)."""

    name: str
    dtype: str
    per: str
    pad: int | float | None
    required: bool
    stage: str
    width: str = ""
    attr: str = ""
    doc: str = ""

    @property
    def attribute(self) -> str:
        return self.attr or self.name

    @property
    def np_dtype(self) -> np.dtype:
        """The dtype in this machine's byte order (what arrays in memory hold)."""
        return np.dtype(self.dtype).newbyteorder("=")

    @property
    def on_wire(self) -> bool:
        return self.stage != "trainer"


FIELDS: dict[str, Field] = {f.name: f for f in (
    Field("tokens", "<i4", TOKEN, 0, True, "source", doc="the sample's tokens (prompt and response)"),
    Field("loss_mask", "|u1", TOKEN, 0, True, "source", attr="loss_masks",
          doc="1 where the token is a training target, predicted from the tokens before it (never the first)"),
    Field("advantages", "<f4", SAMPLE, None, True, "pipeline", doc="advantage (policy_gradient) or reward"),
    Field("rewards", "<f4", SAMPLE, None, True, "source", doc="raw reward"),
    Field("sample_ids", "<i8", SAMPLE, None, True, "source", doc="run-unique sample id (exactly-once checks)"),
    Field("logprobs", "<f4", TOKEN, 0.0, False, "generator",
          doc="the generator's log-probability of each token (0 on the prompt)"),
    Field("versions", "<i8", SAMPLE, None, False, "generator",
          doc="weight version the sample was generated with (its oldest token's)"),
    Field("routed_experts", "<i2", TOKEN, NOT_ROUTED, False, "generator", width="routed_width",
          doc="routing replay: the experts the generator routed each token to, W = MoE layers × top-k per token "
              "(layer-major), -1 where it routed none"),
    Field("token_versions", "<i8", TOKEN, -1, False, "generator",
          doc="partial rollouts: the weight version of every token (-1 on the prompt)"),
    Field("old_logprobs", "<f4", TOKEN, 0.0, False, "trainer",
          doc="policyLoss.oldLogprobs trainer: log pi_old of each token, recomputed by the trainer"),
)}

RESERVED = ("values", "group_id", "has_reward", "group_ids")  # attributes of SampleArrays and its subclasses
OFFSETS_DTYPE = np.dtype(np.int64)  # the payload's `offsets` [n + 1]: sample i is tokens[offsets[i]:offsets[i+1]]


# ---------------------------------------------------------------------------------------------------- the table
def check_row(f: Field, table: dict[str, Field] | None = None) -> None:
    """ValueError naming the field when `f` is not a well-formed row, or clashes with a row of `table`."""
    where = f"sample field {f.name!r}"
    if not f.name.isidentifier() or f.name == "offsets":
        raise ValueError(f"{where}: the name must be an identifier other than 'offsets'")
    if not f.attribute.isidentifier() or f.attribute.startswith("_") or f.attribute in RESERVED or \
            hasattr(SampleArrays, f.attribute):
        raise ValueError(f"{where}: attribute {f.attribute!r} is taken by the holders of the samples "
                         f"({', '.join(RESERVED)} and SampleArrays' own)")
    try:
        dtype = np.dtype(f.dtype)
    except TypeError:
        raise ValueError(f"{where}: dtype {f.dtype!r} is not a numpy dtype") from None
    if dtype.kind not in "biuf" or dtype.str != f.dtype or f.dtype[0] not in "<|":
        raise ValueError(f"{where}: dtype {f.dtype!r} must be a numeric dtype spelled little-endian "
                         f"('<i4', '<f4', '|u1', ...)")
    if f.per not in (TOKEN, SAMPLE):
        raise ValueError(f"{where}: per must be {TOKEN!r} or {SAMPLE!r}, got {f.per!r}")
    if f.stage not in STAGES:
        raise ValueError(f"{where}: stage must be one of {STAGES}, got {f.stage!r}")
    if f.per == SAMPLE and (f.pad is not None or f.width):
        raise ValueError(f"{where}: a per-sample field has no pad and no width")
    if f.per == TOKEN and (f.pad is None or np.array(f.pad).astype(dtype) != f.pad):
        raise ValueError(f"{where}: pad {f.pad!r} must be a value of {dtype.name}")
    if f.required and not f.on_wire:
        raise ValueError(f"{where}: a field the trainer fills cannot be required in a payload")
    if f.width and not f.width.isidentifier():
        raise ValueError(f"{where}: width must name W (an identifier), got {f.width!r}")
    for other in (table or {}).values():
        if other.name == f.name or other.attribute == f.attribute or f.width and f.width in (
                other.width, other.name) or f.name == other.width:
            raise ValueError(f"{where}: name, attribute or width clashes with the field {other.name!r}")


def register_field(f: Field) -> None:
    """Add a row to the table (a plug-in's field, a test's); ValueError naming it when it is malformed or taken."""
    check_row(f, FIELDS)
    FIELDS[f.name] = f
    _derive()


def unregister_field(name: str) -> None:
    """Remove a row added by `register_field`."""
    FIELDS.pop(name)
    _derive()


# ---------------------------------------------------------------------------------------------------- the wire
PAYLOAD_FIELDS: dict[str, np.dtype] = {}  # a rank payload's arrays, required: the table's + offsets (derived below)
PAYLOAD_OPTIONAL: dict[str, np.dtype] = {}  # ... and optional ones; both kept up to date by `register_field`
_BY_ATTR: dict[str, Field] = {}


def _derive() -> None:
    """The views of the table that are looked up often, rebuilt in place whenever the table changes. `offsets` comes
    right after `tokens`: the payload's layout since its first version."""
    PAYLOAD_FIELDS.clear()
    PAYLOAD_OPTIONAL.clear()
    for f in FIELDS.values():
        if f.on_wire:
            (PAYLOAD_FIELDS if f.required else PAYLOAD_OPTIONAL)[f.name] = np.dtype(f.dtype)
        if f.name == "tokens":
            PAYLOAD_FIELDS["offsets"] = OFFSETS_DTYPE
    _BY_ATTR.clear()
    _BY_ATTR.update({f.attribute: f for f in FIELDS.values()})


_derive()


# ---------------------------------------------------------------------------------------------------- the arrays
class SampleArrays:
    """The table's fields of a list of samples, by name: a per-token field is a list with one array per sample (its
    tokens' values; [tokens, W] when the field has a width), a per-sample field one array [n]; None where a sample
    set does not have the field (optional ones, and advantages before the pipeline computes them).

    Read and written by attribute (`g.tokens`, `g.loss_masks`, `samples.logprobs = ...`: the table's `attribute`)
    or by name (`get`, `set`); other attributes (a group's id) are plain attributes of the subclass."""

    def __init__(self, **values: Any):
        object.__setattr__(self, "values", {})
        for attr, value in values.items():
            if attr not in _BY_ATTR:
                raise TypeError(f"{type(self).__name__}: {attr!r} is not a sample field (contract.fields.FIELDS)")
            self.values[_BY_ATTR[attr].name] = value

    def __getattr__(self, attr: str) -> Any:  # only for names that are not plain attributes: the table's fields
        f = _BY_ATTR.get(attr)
        if f is None or "values" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__} has no attribute {attr!r}")
        return self.values.get(f.name)

    def __setattr__(self, attr: str, value: Any) -> None:
        f = _BY_ATTR.get(attr)
        if f is None:
            object.__setattr__(self, attr, value)
        else:
            self.values[f.name] = value

    def get(self, name: str) -> Any:
        return self.values.get(name)

    def set(self, name: str, value: Any) -> None:
        if name not in FIELDS:
            raise KeyError(f"{name!r} is not a sample field (contract.fields.FIELDS)")
        self.values[name] = value

    def __len__(self) -> int:
        return len(self.values["tokens"])

    def __repr__(self) -> str:
        extra = {k: v for k, v in self.__dict__.items() if k != "values"}
        return f"{type(self).__name__}({len(self)} samples, fields {sorted(self.values)}, {extra})"

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.values["tokens"]]

    def payload(self, indices: list[int] | np.ndarray) -> dict[str, np.ndarray]:
        """The rank payload of the samples at `indices`, in that order: each field on the wire flat over them (a
        field with a width: token t's W values at t·W … (t+1)·W − 1), and `offsets`. ValueError naming a required
        field the samples lack."""
        idx = np.asarray(indices, dtype=np.int64)
        out: dict[str, np.ndarray] = {}
        for f in FIELDS.values():
            value = self.values.get(f.name)
            if not f.on_wire or value is None and not f.required:
                continue
            if value is None:
                raise ValueError(f"samples: the required field {f.name!r} is missing")
            if f.per == SAMPLE:
                out[f.name] = np.asarray(value)[idx].astype(f.np_dtype)
            else:
                out[f.name] = (np.concatenate([value[i] for i in idx]).astype(f.np_dtype).reshape(-1) if len(idx)
                               else np.zeros(0, f.np_dtype))
            if f.name == "tokens":
                offsets = np.zeros(len(idx) + 1, dtype=OFFSETS_DTYPE)
                np.cumsum([len(value[i]) for i in idx], out=offsets[1:])
                out["offsets"] = offsets
        return out


def concat(parts: list[SampleArrays]) -> dict[str, Any]:
    """The fields of `parts` one after the other, by name (what `Samples` holds for a rollout's groups): a field is
    there when every part has it (an optional one is None otherwise); ValueError naming a required field that a
    part lacks."""
    out: dict[str, Any] = {}
    for f in FIELDS.values():
        values = [p.values.get(f.name) for p in parts]
        if not parts or any(v is None for v in values):
            if f.required and f.on_wire and parts:
                raise ValueError(f"samples: the required field {f.name!r} is missing in some group")
            continue
        out[f.name] = (np.concatenate(values).astype(f.np_dtype) if f.per == SAMPLE
                       else [a for v in values for a in v])
    return out


# ---------------------------------------------------------------------------------------------------- JSON form
def _b64(a: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(a).astype(dtype).tobytes()).decode()


def arrays_to_json(arrays: SampleArrays) -> dict[str, Any]:
    """The fields of `arrays` as JSON values (the rollout's resume state): `offsets` (a list), then per field the
    base64 of its little-endian bytes, flat over the samples (None when absent) and, for a field with a width, W
    under the width's name. Fields the trainer fills are not written."""
    tokens = arrays.values["tokens"]
    offsets = np.zeros(len(tokens) + 1, np.int64)
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    out: dict[str, Any] = {"offsets": offsets.tolist()}
    for f in FIELDS.values():
        value = arrays.values.get(f.name)
        if not f.on_wire:
            continue
        if value is None:
            out[f.name] = None
        elif f.per == SAMPLE:
            out[f.name] = _b64(np.asarray(value), f.dtype)
        else:
            out[f.name] = _b64(np.concatenate(value) if len(value) else np.zeros(0), f.dtype)
            if f.width:
                out[f.width] = int(value[0].shape[1]) if len(value) else 0
    return out


def arrays_from_json(d: dict[str, Any]) -> dict[str, Any]:
    """The fields written by `arrays_to_json`, by name (arrays in memory byte order; a field absent or null is
    absent)."""
    offsets = [int(x) for x in d["offsets"]]
    out: dict[str, Any] = {}
    for f in FIELDS.values():
        if not f.on_wire or d.get(f.name) is None:
            continue
        flat = np.frombuffer(base64.b64decode(d[f.name]), dtype=f.dtype).astype(f.np_dtype)
        if f.per == SAMPLE:
            out[f.name] = flat
            continue
        if f.width:
            flat = flat.reshape(offsets[-1], int(d[f.width]))
        out[f.name] = np.split(flat, offsets[1:-1]) if len(offsets) > 1 else []
    return out


for _row in FIELDS.values():  # the table's own rows obey the rules a registered row must (checked once, on import)
    check_row(_row, {k: v for k, v in FIELDS.items() if k != _row.name})
