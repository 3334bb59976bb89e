"""`file://` store: a directory on a local volume (or a shared one; no flock: O_EXCL creates, links and renames
only; immutable payload files are read through read-only memory maps). This module lays the store out and performs
its I/O (through `file_io.Volume`); every decision (what a check refuses, whether a claim may be taken, what a wait
returns, which rollouts a release deletes) is a rule of `common.py`, the same the Redis backend follows.

Layout under the root directory:

    EPOCH                                      {"id", "created", "host"}: created once, never rewritten
    attempts/00000003                          one empty file per attempt that used the store; the largest is current
    writer/00000003.json                       the rollout writer's claim for attempt 3 (owner identity)
    rollouts/00000007/a00000003/rank-00000.bin rank payloads written by attempt 3 (wire format)
    rollouts/00000007/a00000003/schedule.json  the schedule (JSON)
    rollouts/00000007/COMMIT                   commit marker (`common.Marker`: rollout, dp_size, attempt, schedule
                                               CRC-32, check value), linked into place last, never overwritten
    acks/00000007/rank-00000                   one empty file per acknowledging rank
    weights/00000003/a00000002/tensors.bin     weight version 3 written by attempt 2: named arrays (wire format)
    weights/00000003/a00000002/meta.json       its metadata (JSON)
    weights/00000003/COMMIT                    its commit marker (`common.WeightsMarker`: version, attempt, bytes,
                                               meta CRC-32, check value), linked into place last, never overwritten
    weights/00000004/a00000002/part-o0001-000003.bin  a version in parts (`store/parts.py`): owner 1's part 3
    weights/00000004/a00000002/owner-0001.json owner 1's record (its parts, its meta, or its error)
    weights/00000004/a00000002/parts.json      the parts index the COMMIT marker commits (meta + parts)
    kv/<key>.json                              put_json/get_json
    FINISHED                                   {"num_rollouts": n}, written by finish(n)
    RELEASED                                   {"upto": k}: rollouts < k may have been deleted

Every file is written as a temporary file in the same directory (`.tmp.<name>.<pid>.<random>`), fsync'ed, and
renamed over its final name (or, for COMMIT, EPOCH and writer claims, hard-linked: the link fails if the name exists,
so the first one wins and nothing is overwritten); a reader sees the old file or the new one, never a half-written
one. The commit marker is linked after the payloads and the schedule (and their directory) were fsync'ed, so a
reader that sees COMMIT sees the whole rollout. A writer killed before the marker leaves files without COMMIT, which
readers ignore; a re-publish writes them again and commits. Payloads and schedule live in a directory of the
writer's attempt, so a fenced-off writer of an older attempt can never overwrite what a newer one committed. Weight
versions (trainer rank 0 writes, the rollout's engine reads) follow the same protocol (`_commit_directory`), fenced by
the epoch and the attempt (the trainer is no rollout writer: it holds no writer claim).

A version in parts: each owner writes its part files and its record into this attempt's directory (each file
atomically); the committing rank checks every record and part (`parts.parts_plan`), writes the index and links
COMMIT, or, when an owner failed, removes the attempt's directory and raises `IncompleteWeights` naming it.

Fencing: every write first checks the epoch (a changed or vanished EPOCH is `StoreDataLost`), the current attempt
(a newer one is `StaleAttempt`) and, for the writer's operations, the writer claim (`WriterConflict`). The checks
run just before each write, not atomically with it (no locks on a shared volume); COMMIT's link is atomic.

Query options: `file:///path?fsync=0` skips fsync (faster; safe against process crashes, not against a node crash).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np

from trainingrun.contract.errors import StoreError
from trainingrun.contract.payload import RankPayload
from trainingrun.store.base import IncompleteWeights
from trainingrun.store import common
from trainingrun.store import parts as _parts
from trainingrun.store.file_io import Volume
from trainingrun.store.wire import (decode_arrays, decode_payload, encode_arrays_parts, encode_json,
                                    encode_payload_parts)

COMMIT = "COMMIT"
SCHEDULE = "schedule.json"
PARTS_INDEX = "parts.json"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def _numbered(names: list[str]) -> list[int]:
    """The 8-digit numbers among directory entry names (rollouts, weight versions, attempts), ascending."""
    return sorted(int(n) for n in names if len(n) == 8 and n.isdigit())


class FileStore:
    """A Store in a directory. See the module docstring for the layout, atomicity and fencing."""

    def __init__(self, root: str | Path, *, url: str | None = None, fsync: bool = True, attempt: int | None = None):
        self.root = Path(root)
        self.url = url or f"file://{self.root}"
        self.attempt = common.check_attempt(attempt)
        self._io = Volume(self.url, fsync=fsync)
        self._rollouts = self.root / "rollouts"
        self._epoch: str | None = None  # the epoch id this handle has seen (None: not yet)
        self._owner: common.Owner | None = None  # our writer claim, while held
        try:
            if self.root.exists() and not self.root.is_dir():
                raise StoreError(f"store {self.url}: {self.root} exists and is not a directory")
            for sub in ("rollouts", "acks", "kv", "attempts", "writer", "weights"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._io.error("open", self.root, exc) from exc

    @classmethod
    def from_url(cls, url: str, *, attempt: int | None = None) -> FileStore:
        parts = urlsplit(url)
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ValueError(f"store url: {url!r} has no path (use file:///abs/path or file://relative/path)")
        root = Path(path) if path.startswith("/") else Path.cwd() / path
        query = parse_qs(parts.query)
        fsync = query.get("fsync", ["1"])[-1] not in ("0", "false", "no")
        return cls(root, url=url, fsync=fsync, attempt=attempt)

    # ------------------------------------------------------------------ places
    def _rdir(self, rollout: int) -> Path:
        return self._rollouts / f"{rollout:08d}"

    def _ddir(self, rollout: int, attempt: int | None) -> Path:
        """Where attempt `attempt` writes rollout `rollout`'s payloads and schedule (unfenced: attempt 0)."""
        return self._rdir(rollout) / f"a{attempt or 0:08d}"

    def _adir(self, rollout: int) -> Path:
        return self.root / "acks" / f"{rollout:08d}"

    def _wdir(self, version: int) -> Path:
        return self.root / "weights" / f"{version:08d}"

    def _where(self, path: Path) -> str:
        return f"store {self.url}: {path}"

    def _committed(self, sub: str = "rollouts") -> list[int]:
        """The committed rollouts (or, with sub="weights", weight versions) in ascending order."""
        d = self.root / sub
        return [k for k in _numbered(self._io.listdir(d)) if (d / f"{k:08d}" / COMMIT).exists()]

    def _counter(self, name: str, field: str) -> int | None:
        value = self._io.read_json(self.root / name)
        return None if value is None else common.stored_count(value, where=self._where(self.root / name), field=field)

    # ------------------------------------------------------------------ fencing
    def _epoch_id(self, *, create: bool) -> str | None:
        """Check the store's epoch against the one this handle saw (StoreDataLost when it vanished or changed);
        with `create`, a store that never had one gets one. Returns the id."""
        path = self.root / "EPOCH"
        if self._epoch is not None and not self.root.is_dir():
            raise common.lost(self.url, f"its directory {self.root} is gone (this process saw epoch {self._epoch})")
        found = common.epoch_id(self._io.read(path), self._epoch, url=self.url, where=str(path))
        if found is None and create:
            self._io.create_once(path, [encode_json(common.new_epoch())])
            found = common.epoch_id(self._io.read(path), None, url=self.url, where=str(path))
        self._epoch = self._epoch or found
        return self._epoch

    def _owner_at(self, path: Path) -> common.Owner | None:
        value = self._io.read_json(path)
        return None if value is None else common.Owner.from_json(value, where=self._where(path))

    def _claims(self) -> list[Path]:
        """The writer claims (`writer/<attempt>.json`), oldest attempt first."""
        d = self.root / "writer"
        return [d / n for n in sorted(self._io.listdir(d)) if len(n) == 13 and n[:8].isdigit() and n.endswith(".json")]

    def _claim(self) -> tuple[Path | None, common.Owner | None]:
        """The newest writer claim (the one of the newest attempt): its path and owner; (None, None) if none."""
        claims = self._claims()
        return (claims[-1], self._owner_at(claims[-1])) if claims else (None, None)

    def _guard(self, op: str, *, writer: bool = False) -> None:
        """Before a write: the epoch, the current attempt and (for the writer's operations) the writer claim."""
        self._epoch_id(create=True)
        attempts = _numbered(self._io.listdir(self.root / "attempts"))
        common.check_current(self.attempt, attempts[-1] if attempts else None, url=self.url, op=op)
        if writer:
            me = self._owner or common.Owner.me(self.attempt)
            common.check_writer(self._claim()[1], me, held=self._owner is not None, url=self.url, op=op)

    def enter_attempt(self) -> int:
        attempt = common.require_attempt(self.attempt)
        self._guard("opening the store")
        path = self.root / "attempts" / f"{attempt:08d}"
        if not path.exists():
            self._io.create_once(path, [b""])
        return attempt

    def claim_writer(self) -> dict[str, Any]:
        if self.attempt is not None:
            self.enter_attempt()
        else:
            self._epoch_id(create=True)
        me = self._owner or common.Owner.me(self.attempt)
        mine = self.root / "writer" / f"{self.attempt or 0:08d}.json"
        for _ in range(5):
            path, current = self._claim()
            if common.may_claim(current, me, url=self.url):
                break
            if current is not None and path == mine:
                self._io.retire(path)  # a dead owner's claim of our attempt: moved aside (one rename wins)
            if self._io.create_once(mine, [encode_json(me.to_json())]):
                break
        else:
            raise StoreError(f"store {self.url}: could not claim the writer ({mine}): it kept changing")
        self._owner = me
        for older in self._claims():  # claims of older attempts are superseded
            if int(older.name[:8]) < (self.attempt or 0):
                older.unlink(missing_ok=True)
        return me.to_json()

    def writer(self) -> dict[str, Any] | None:
        """The current writer claim's owner record (None when nobody holds one)."""
        owner = self._claim()[1]
        return None if owner is None else owner.to_json()

    def epoch(self) -> str | None:
        """The store's epoch id (None before the store was first written)."""
        return self._epoch_id(create=False)

    # ------------------------------------------------------------------ writer
    def is_committed(self, rollout: int) -> bool:
        return (self._rdir(common.check_rollout(rollout)) / COMMIT).exists()

    def publish_rollout(
        self, rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any], *, _after_payloads=None
    ) -> bool:
        """Publish atomically; returns False (and writes nothing) if the rollout is already committed.

        `_after_payloads` is a test hook called after the payloads and schedule are written, before the commit.
        """
        schedule_bytes, marker = common.publish_plan(rollout, payloads, schedule, self.attempt)
        files = [(_rank_file(r), lambda r=r: encode_payload_parts(payloads[r])) for r in range(marker.dp_size)]
        return self._commit_directory(self._rdir(rollout), [*files, (SCHEDULE, lambda: [schedule_bytes])],
                                      marker.encode(), f"rollout {rollout}", writer=True, hook=_after_payloads)

    def _commit_directory(self, d: Path, files: list, marker: bytes, what: str, *, writer: bool, hook=None) -> bool:
        """The commit protocol of rollouts and weight versions: False (nothing written) when `d` is committed; else
        the fencing checks, each file (name, () -> chunks) written atomically into this attempt's directory inside
        `d` (temporary files of a killed writer removed first), that directory fsynced, the checks again, then the
        COMMIT `marker` linked into `d` (never overwritten: False when someone committed meanwhile, theirs stands)
        and `d` fsynced. `writer`: the rollout writer's claim is checked too. `hook` runs before the marker (tests)."""
        if (d / COMMIT).exists():
            return False
        ddir = d / f"a{self.attempt or 0:08d}"
        self._guard(f"publishing {what}", writer=writer)
        try:
            ddir.mkdir(parents=True, exist_ok=True)
            for stale_tmp in [*ddir.glob(".tmp.*"), *d.glob(".tmp.*")]:
                stale_tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise self._io.error("create", ddir, exc) from exc
        for name, chunks in files:
            self._io.write_atomic(ddir / name, chunks())
        if hook is not None:
            hook()
        self._io.fsync_dir(ddir)
        self._guard(f"committing {what}", writer=writer)
        if not self._io.create_once(d / COMMIT, [marker]):
            return False  # committed meanwhile by someone else: theirs stands
        self._io.fsync_dir(d)
        return True

    def finish(self, num_rollouts: int) -> None:
        common.check_rollout(num_rollouts, "num_rollouts")
        self._guard("finishing the stream", writer=True)
        self._io.write_atomic(self.root / "FINISHED", [encode_json({"num_rollouts": num_rollouts})])

    def finished(self) -> int | None:
        """num_rollouts given to finish(), or None while the stream is open."""
        return self._counter("FINISHED", "num_rollouts")

    def _ledger(self, below: int | None = None) -> common.Ledger:
        """The committed rollouts (those below `below`) with their markers and how many ranks acked each."""
        ledger = []
        for k in self._committed():
            if below is not None and k >= below:
                break
            path = self._rdir(k) / COMMIT
            raw = self._io.read(path, limit=4096)
            acks = [n for n in self._io.listdir(self._adir(k)) if n.startswith("rank-") and n[5:].isdigit()]
            ledger.append((k, None if raw is None else common.Marker.decode(raw, where=self._where(path)), len(acks)))
        return ledger

    def pending_rollouts(self) -> int:
        self._epoch_id(create=False)
        return common.pending_count(self._ledger())

    # ------------------------------------------------------------------ readers
    def _released(self) -> int:
        return self._counter("RELEASED", "upto") or 0

    def wait_rollout(self, rollout: int, timeout: float | None = None) -> bool:
        marker = self._rdir(common.check_rollout(rollout)) / COMMIT

        def check() -> bool | None:
            self._epoch_id(create=False)
            return common.wait_verdict(rollout, committed=marker.exists(), released=self._released,
                                       finished=self.finished, url=self.url)

        # polls back off to 50 ms (a few stat calls): an on-policy loop waits here once per rollout, and a 250 ms cap
        # added ~0.12 s per rollout to the demo's ~0.65 s
        return common.poll(check, timeout, f"rollout {rollout} in store {self.url} (key {marker})", max_interval=0.05)

    def _require_committed(self, rollout: int) -> common.Marker:
        path = self._rdir(common.check_rollout(rollout)) / COMMIT
        raw = self._io.read(path, limit=4096)
        if raw is None:
            self._epoch_id(create=False)  # a store that lost its data says so, not "not committed"
        return common.committed_marker(raw, rollout, url=self.url, where=str(path))

    def _gone(self, rollout: int, path: Path) -> StoreError:
        """A committed rollout's part is missing: released meanwhile, or the store lost it."""
        self._epoch_id(create=False)
        return common.part_missing(rollout, str(path), released=self._released(), committed=self.is_committed(rollout),
                                   url=self.url)

    def payload_path(self, rollout: int, rank: int) -> Path:
        """Where the committed payload of `rank` lives (for tools and tests)."""
        return self._ddir(rollout, self._require_committed(rollout).attempt) / _rank_file(rank)

    def read_schedule(self, rollout: int) -> dict[str, Any]:
        marker = self._require_committed(rollout)
        path = self._ddir(rollout, marker.attempt) / SCHEDULE
        data = self._io.read(path)
        if data is None:
            raise self._gone(rollout, path)
        return common.committed_json(marker, data, where=self._where(path))

    def read_payload(self, rollout: int, rank: int) -> RankPayload:
        marker = self._require_committed(rollout)
        path = self._ddir(rollout, marker.attempt) / _rank_file(common.payload_rank(marker, rank, url=self.url))
        mapped = self._io.map_arrays(path)
        if mapped is None:
            raise self._gone(rollout, path)
        return decode_payload(mapped[0], where=self._where(path), header=mapped[1])

    def ack(self, rollout: int, rank: int) -> None:
        common.check_rollout(rollout)
        self._guard(f"acknowledging rollout {rollout}")
        adir = self._adir(rollout)
        path = adir / f"rank-{rank:05d}"
        try:
            adir.mkdir(parents=True, exist_ok=True)
            path.touch()
        except OSError as exc:
            raise self._io.error("write", path, exc) from exc

    def _delete(self, d: Path, *more: Path) -> None:
        """Delete a committed directory: its COMMIT first (invisible at once), then the rest."""
        try:
            (d / COMMIT).unlink(missing_ok=True)
            for path in (d, *more):
                shutil.rmtree(path, ignore_errors=True)
        except OSError as exc:
            raise self._io.error("delete", d, exc) from exc

    def release_upto(self, rollout: int) -> None:
        common.check_rollout(rollout)
        self._guard(f"releasing rollouts below {rollout}")
        released = self._released()
        delete, upto = common.release_plan(rollout, self._ledger(below=rollout), released)
        for k in delete:
            self._delete(self._rdir(k), self._adir(k))
        if upto is not None:
            self._io.write_atomic(self.root / "RELEASED", [encode_json({"upto": upto})])

    # ------------------------------------------------------------------ weights
    def publish_weights(self, version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any], *,
                        _after_tensors=None) -> bool:
        """Publish weight version `version` atomically (tensors, meta, then COMMIT; fenced by the epoch and the
        attempt: a trainer of an older attempt is refused); False (nothing written) when already committed.

        `_after_tensors` is a test hook called after tensors and meta are written, before the commit."""
        common.check_weights(version, arrays, meta)
        if (self._wdir(version) / COMMIT).exists():
            return False
        parts, meta_bytes, marker = common.weights_plan(version, arrays, meta, self.attempt)
        return self._commit_directory(self._wdir(version), [("tensors.bin", lambda: parts),
                                                            ("meta.json", lambda: [meta_bytes])],
                                      marker.encode(), f"weight version {version}", writer=False, hook=_after_tensors)

    def _own_dir(self, version: int) -> Path:
        """This attempt's directory of weight version `version` (its parts, records and index)."""
        return self._wdir(version) / f"a{self.attempt or 0:08d}"

    def begin_weights(self, version: int) -> bool:
        if (self._wdir(common.check_rollout(version, "version")) / COMMIT).exists():
            return False
        self._guard(f"publishing weight version {version}")
        shutil.rmtree(self._own_dir(version), ignore_errors=True)  # a publish of this attempt that never committed
        try:
            self._own_dir(version).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._io.error("create", self._own_dir(version), exc) from exc
        return True

    def write_weights_part(self, version: int, owner: int, index: int, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        _parts.check_part(version, owner, index, arrays)
        name = _parts.part_name(owner, index)
        chunks = encode_arrays_parts(arrays)
        self._guard(f"publishing weight version {version}")
        ddir = self._own_dir(version)
        try:
            ddir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._io.error("create", ddir, exc) from exc
        self._io.write_atomic(ddir / f"part-{name}.bin", chunks)
        return {"name": name, "nbytes": sum(memoryview(c).nbytes for c in chunks), "chunks": 1}

    def write_weights_owner(self, version: int, owner: int, *, parts: list[dict[str, Any]] | None = None,
                            meta: dict[str, Any] | None = None, error: str | None = None) -> None:
        data = _parts.owner_record(version, owner, parts, meta, error)
        self._guard(f"publishing weight version {version}")
        self._io.write_atomic(self._own_dir(version) / f"owner-{owner:04d}.json", [data])

    def commit_weights(self, version: int, owners: int, meta: dict[str, Any]) -> bool:
        d, ddir = self._wdir(common.check_rollout(version, "version")), self._own_dir(version)
        if (d / COMMIT).exists():
            return False

        def stored(part: dict[str, Any]) -> int | None:
            path = ddir / f"part-{part['name']}.bin"
            return path.stat().st_size if path.is_file() else None

        records = [self._io.read(ddir / f"owner-{o:04d}.json") for o in range(owners)]
        try:
            index, marker = _parts.parts_plan(version, records, meta, self.attempt, url=self.url, stored=stored)
        except IncompleteWeights:
            shutil.rmtree(ddir, ignore_errors=True)  # the failed publish's parts: never committed
            raise
        return self._commit_directory(d, [(PARTS_INDEX, lambda: [index])], marker.encode(),
                                      f"weight version {version}", writer=False)

    def latest_weights(self) -> int | None:
        self._epoch_id(create=False)
        versions = self._committed("weights")
        return versions[-1] if versions else None

    def _weights_gone(self, version: int, path: Path) -> StoreError:
        """A committed version's part is missing: released meanwhile, or the store lost it."""
        self._epoch_id(create=False)
        committed = (self._wdir(version) / COMMIT).exists()
        return common.weights_missing(version, str(path), committed=committed, url=self.url)

    def weights_path(self, version: int) -> Path:
        """Where the tensors of a committed weight version live (for tools and tests)."""
        return self._wdir(version) / f"a{self._weights_marker(version).attempt:08d}" / "tensors.bin"

    def _weights_marker(self, version: int) -> common.WeightsMarker:
        path = self._wdir(common.check_rollout(version, "version")) / COMMIT
        raw = self._io.read(path, limit=4096)
        if raw is None:
            self._epoch_id(create=False)
        return common.committed_weights(raw, version, url=self.url, where=str(path), chunks=1)

    def read_weights(self, version: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(arrays, meta) of a committed version, every tensor checked (marker, meta CRC, size, header, checksums);
        StoreError when it is not (or no longer) committed, CorruptPayload naming the path when damaged."""
        marker = self._weights_marker(version)
        ddir = self._wdir(version) / f"a{marker.attempt:08d}"
        if marker.parts:
            return self._read_parts(version, marker, ddir)
        meta_path, path = ddir / "meta.json", ddir / "tensors.bin"
        meta_bytes = self._io.read(meta_path)
        if meta_bytes is None:
            raise self._weights_gone(version, meta_path)
        meta = common.committed_json(marker, meta_bytes, where=self._where(meta_path))
        mapped = self._io.map_arrays(path, spec=None, check_size=lambda n: common.check_weights_size(
            n, marker, where=self._where(path)))
        if mapped is None:
            raise self._weights_gone(version, path)
        return decode_arrays(mapped[0], where=self._where(path), header=mapped[1]), meta

    def _read_parts(self, version: int, marker: common.WeightsMarker, ddir: Path) -> tuple[dict, dict[str, Any]]:
        """A version in parts, assembled: the index (checked against the marker), then every part, each mapped
        read-only and checked (size, header, checksums); no array in two parts."""
        index_path = ddir / PARTS_INDEX
        data = self._io.read(index_path)
        if data is None:
            raise self._weights_gone(version, index_path)
        meta, described = _parts.committed_parts(marker, data, where=self._where(index_path))
        arrays: dict[str, np.ndarray] = {}
        for part in described:
            path = ddir / f"part-{part['name']}.bin"
            mapped = self._io.map_arrays(path, spec=None, check_size=lambda n, p=part, w=self._where(path):
                                         _parts.check_part_size(n, p, where=w))
            if mapped is None:
                raise self._weights_gone(version, path)
            _parts.join_part(arrays, decode_arrays(mapped[0], where=self._where(path), header=mapped[1]),
                             where=self._where(path))
        return arrays, meta

    def release_weights_below(self, version: int) -> None:
        """Delete weight versions < `version`: the committed ones (commit marker first: a reader never sees half a
        version) with their parts, and the directories of those never committed (a publish that failed or died);
        fenced like every write."""
        common.check_rollout(version, "version")
        self._guard(f"releasing weight versions below {version}")
        for v in _numbered(self._io.listdir(self.root / "weights")):
            if v >= version:
                break
            self._delete(self._wdir(v))

    # ------------------------------------------------------------------ shared state
    def put_json(self, key: str, value: dict[str, Any]) -> None:
        data = encode_json(value, where=f"put_json({key!r})")
        path = self.root / "kv" / f"{common.check_key(key)}.json"
        self._guard(f"writing {key}")
        self._io.write_atomic(path, [data])

    def get_json(self, key: str) -> dict[str, Any] | None:
        return self._io.read_json(self.root / "kv" / f"{common.check_key(key)}.json")

    def close(self) -> None:
        """Release the writer claim if this handle holds it."""
        owner, self._owner = self._owner, None
        if owner is None:
            return
        path = self.root / "writer" / f"{self.attempt or 0:08d}.json"
        try:
            if common.holds(self._owner_at(path), owner):
                path.unlink(missing_ok=True)
        except (StoreError, OSError):
            pass  # best effort: a dead owner's claim is taken over by the next writer of its attempt

    def __repr__(self) -> str:
        return f"FileStore({self.url!r})"
