"""Checkpoints on disk: layout, atomic commit, verification, fallback, keep-N and attempt fencing.

This module is the file protocol; the model and optimizer shards are written and read by Megatron's distributed
checkpointing (`checkpoint_megatron.py`), handed in as two callables, so everything here is tested without Megatron.

Layout under `spec.trainer.checkpoint.path` (relative paths resolve against the process's working directory):
  step_00000010/             a complete checkpoint (global step 10)
    dist/                    Megatron `dist_checkpointing` directory (torch_dist format: .metadata, __<r>_<i>.distcp,
                             common.pt, metadata.json): model and optimizer, sharded so that any data-/tensor-parallel
                             size can load it
    state.pt                 LR scheduler state + rank 0's RNG state (`torch.load(weights_only=True)`)
    rng/<pp>-<tp>-<ep>-<dp>.safetensors  each rank's RNG streams (the trainer's `write_shards` writes them beside
                             the shards: `trainer/rng.py`), uint8 tensors; restored at the same layout
    meta.json                who wrote it: run, attempt, data/tensor-parallel sizes, the model spec
    progress.json            {global_step, rollout, step_in_rollout, samples_consumed, tokens_consumed, ...}
    COMPLETE                 written last: {"format": 2, "attempt", "files": {path: {"size", "sha256"}}}
  .tmp-step_00000010-a1/     being written by attempt 1; never loaded, removed by the next save
  step_00000012.unloadable-a3/  a checkpoint attempt 3 could not load and fell back from (kept for inspection)
  .attempts/<attempt>        one empty file per attempt that resumed here (the fence, below)
  .base-digest.json          a LoRA run's model.hf digest cache (`modeling.lora_base`)
  (a run started from a Hugging Face directory also keeps its config + tokenizer files in step_*/hf/; a LoRA run's
  dist/ holds its adapters and their optimizer state only, and meta.json names the base and its digest:
  `checkpoint_megatron.py`, `modeling.lora_base`)

Save (every rank calls it): rank 0 checks the fence and creates the temporary directory → every rank writes its
shards (`write_shards`, collective) → every rank hashes its share of the files (rank r: files r, r+W, ...) →
rank 0 writes state.pt, meta.json, progress.json and finally COMPLETE with the size and SHA-256 of every file
(each fsynced), checks the fence again, renames the directory to its final name, fsyncs the parent, prunes.
A crash at any point leaves either the old newest checkpoint or the new one complete: a directory without COMPLETE,
or not named `step_<digits>`, is never loaded. A save that fails because the checkpoints' volume is full raises
`OSError(ENOSPC)` naming the root, on whichever rank found it full and through whichever writer (`_full_volume_raises`;
rank 0's commit tells every rank), so each rank reports one line and exits 78 instead of a traceback.

Resume: rank 0 records this attempt in the fence; then the complete checkpoints are tried newest first. Each is
verified before anything is loaded (COMPLETE parses, every listed file exists with its size and hash, the torch
metadata pickle references only checkpoint classes), each rank checking its share, and the ranks agree on the
result. A checkpoint that fails (or whose load raises) is named with the reason, and the previous one is tried;
after a successful fallback the failed ones are renamed `*.unloadable-a<attempt>` so that keep-N and the next resume
skip them. When checkpoints exist but none loads, `CheckpointError` names every path and why (the trainer exits 78:
a restart cannot repair them). The previous checkpoint's data must still be in the store: after a save the trainer
releases only rollouts older than the *oldest* kept checkpoint (`SaveResult.release_upto`).

Fencing: a checkpoint commit carries its attempt (COMPLETE, meta.json). An attempt is ordered by (epoch, attempt):
the epoch is the run's creation time (TRAININGRUN_RUN_EPOCH, unix seconds of the TrainingRun's creationTimestamp;
0 for local runs, whose attempts already count up across invocations), so a TrainingRun deleted and re-created with
the same name over the same volume takes the checkpoints over at its attempt 0, and the old run's leftovers are
fenced off. The newest recorded attempt is the largest entry in `.attempts/` (`<attempt>` for epoch 0,
`e<epoch>-a<attempt>` otherwise; created, never rewritten, so recording is race-free); a commit — or a prune — from an
older attempt is refused with `CheckpointFenced`, so a zombie trainer of an old attempt cannot commit over, or delete,
a newer attempt's checkpoints. A trainer that starts with an older attempt than the recorded one is refused the same
way (a zombie, or a new run reusing the directory: the message says how to tell and what to do).
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from trainingrun.diskspace import describe as describe_no_space

MARKER = "COMPLETE"
FORMAT = 2
DIST_DIR = "dist"
FENCE_DIR = ".attempts"
_NAME = re.compile(r"^step_(\d{8,})$")
_HASH_PREFIX = ".hash-"
_CHUNK = 1 << 22
_FENCED = "[fenced] "  # marks a fencing refusal among the reasons the ranks exchange
_NO_SPACE = "[no space] "  # marks a full checkpoint volume among them


class CheckpointError(Exception):
    """No checkpoint under a root can be loaded (the message names each path and why), or one cannot be written."""


class CheckpointFenced(CheckpointError):
    """A newer attempt owns these checkpoints: this (older) attempt may not commit, prune or resume here."""


@dataclass
class TrainingProgress:
    """Where training stands: the next rollout/step to train and the totals so far."""

    global_step: int = 0  # optimizer steps completed
    rollout: int = 0  # rollout holding the next step
    step_in_rollout: int = 0  # index of the next step within that rollout
    samples_consumed: int = 0
    tokens_consumed: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainingProgress:
        return cls(**{k: int(d[k]) for k in ("global_step", "rollout", "step_in_rollout", "samples_consumed")},
                   tokens_consumed=int(d.get("tokens_consumed", 0)))


class Collectives(Protocol):
    """The collective operations the protocol needs (torch.distributed in the trainer, `Solo` in one process)."""

    rank: int
    world: int

    def barrier(self) -> None: ...

    def gather_reasons(self, reason: str | None) -> list[str | None]:
        """Every rank's `reason` (None = fine), on every rank."""

    def broadcast_ints(self, values: list[int] | None) -> list[int]:
        """Rank 0's list, on every rank (the others pass None)."""


class Solo:
    """`Collectives` of a single process."""

    rank, world = 0, 1

    def barrier(self) -> None:
        pass

    def gather_reasons(self, reason: str | None) -> list[str | None]:
        return [reason]

    def broadcast_ints(self, values: list[int] | None) -> list[int]:
        return list(values or [])


# ------------------------------------------------------------------------------------------------ small file helpers
def _fsync_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_name(global_step: int) -> str:
    return f"step_{global_step:08d}"


def step_of(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoints under `root` that carry the COMPLETE marker, oldest first (not yet verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        step = step_of(d)
        if step is not None and d.is_dir() and (d / MARKER).is_file():
            found.append((step, d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def read_json(path: Path) -> dict[str, Any]:
    value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return value


def read_meta(path: str | Path) -> dict[str, Any]:
    """meta.json of a checkpoint directory: run, attempt, dp/tp sizes, model spec."""
    return read_json(Path(path) / "meta.json")


def read_progress(path: str | Path) -> TrainingProgress:
    return TrainingProgress.from_dict(read_json(Path(path) / "progress.json"))


# ------------------------------------------------------------------------------------------------ fencing
_FENCE_ENTRY = re.compile(r"^(?:e(\d{1,18})-a)?(\d{1,18})$")


def _fence_key(entry: str) -> tuple[int, int] | None:
    m = _FENCE_ENTRY.match(entry)
    return (int(m.group(1) or 0), int(m.group(2))) if m else None


def _fence_name(attempt: int, epoch: int) -> str:
    return f"{attempt:08d}" if epoch == 0 else f"e{epoch}-a{attempt:08d}"


def newest_fence(root: str | Path) -> tuple[int, int] | None:
    """The newest (epoch, attempt) recorded in `root`'s fence, None if none."""
    try:
        names = os.listdir(Path(root) / FENCE_DIR)
    except FileNotFoundError:
        return None
    keys = [k for k in map(_fence_key, names) if k is not None]
    return max(keys) if keys else None


def newest_attempt(root: str | Path) -> int | None:
    """The attempt number of the newest recorded attempt in `root`'s fence, None if none."""
    newest = newest_fence(root)
    return None if newest is None else newest[1]


def record_attempt(root: str | Path, attempt: int, epoch: int = 0) -> None:
    """Record `attempt` (of the run created at `epoch`) in the fence (an empty file named after it: creating it never
    races with another writer)."""
    fence = Path(root) / FENCE_DIR
    fence.mkdir(parents=True, exist_ok=True)
    (fence / _fence_name(attempt, epoch)).touch()
    _fsync_dir(fence)


def _describe_epoch(epoch: int) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def fence_reason(root: str | Path, attempt: int, what: str, epoch: int = 0) -> str | None:
    """Why attempt `attempt` (of the run created at `epoch`) may not `what` in `root` (a newer attempt is recorded),
    or None."""
    newest = newest_fence(root)
    if newest is None or newest <= (epoch, attempt):
        return None
    where = f"checkpoints in {Path(root).resolve()}"
    if newest[0] > epoch:
        return (f"{where}: attempt {attempt} may not {what}: a run created later ({_describe_epoch(newest[0])}, "
                f"attempt {newest[1]}) has resumed from them since (this process belongs to a TrainingRun that was "
                "deleted and re-created with the same name, and should have stopped)")
    return (f"{where}: attempt {attempt} may not {what}: attempt {newest[1]} has resumed "
            "from them since (this process belongs to an older attempt that should have stopped)")


# ------------------------------------------------------------------------------------------------ manifest
def digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a file (and fsync it: the hash is only worth writing down for data on disk)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return {"size": size, "sha256": h.hexdigest()}


def _listed_files(directory: Path) -> list[str]:
    """Regular files under `directory` (relative, sorted), without the marker and the per-rank hash notes."""
    out = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if p.is_file() and rel != MARKER and not p.name.startswith(_HASH_PREFIX):
            out.append(rel)
    return out


def _share(items: list[str], rank: int, world: int) -> list[str]:
    return items[rank::world]


# Only these globals may appear in the torch-distributed-checkpoint metadata pickle (`dist/.metadata`), which torch
# reads with a plain `pickle.load`: the checkpoint's own descriptor classes, torch.Size, dtypes and layouts.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_OTHER_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                  ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module in _DCP_MODULES and not name.startswith("__")) or (module, name) in _OTHER_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            import torch  # deferred: torch

            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")


def check_metadata_pickle(path: Path) -> None:
    """Refuse a `.metadata` file that would make torch's `pickle.load` build anything but checkpoint descriptors."""
    with open(path, "rb") as f:
        _MetadataUnpickler(io.BufferedReader(f)).load()


def verify(path: Path, *, rank: int = 0, world: int = 1) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, from this rank's share of its files (None: it can).

    Every rank reads COMPLETE; rank r checks size and SHA-256 of files r, r+W, ... of its manifest (the torch metadata
    pickle also against the allow-list); rank 0 also parses progress.json and meta.json."""
    try:
        marker = read_json(path / MARKER)
        files = marker["files"]
        if marker.get("format") != FORMAT or not isinstance(files, dict):
            return f"{MARKER}: format {marker.get('format')!r} (this trainer reads format {FORMAT} only)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MARKER} is unreadable ({exc.__class__.__name__}: {exc})"
    for rel in _share(sorted(files), rank, world):
        want = files[rel]
        p = path / rel
        try:
            if not p.is_file():
                return f"{rel} is missing"
            size = p.stat().st_size
            if size != want.get("size"):
                return f"{rel} has {size} bytes, {want.get('size')} were written (truncated or replaced)"
            got = digest(p)["sha256"]
            if got != want.get("sha256"):
                return f"{rel} does not match its SHA-256 (corrupted: {got[:12]}… != {str(want.get('sha256'))[:12]}…)"
            if p.name == ".metadata":
                check_metadata_pickle(p)
        except OSError as exc:
            return f"{rel} cannot be read ({exc})"
        except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError, TypeError) as exc:
            return f"{rel} is not a valid checkpoint metadata file ({exc})"
    if rank == 0:
        for name in ("progress.json", "meta.json"):
            if name not in files:
                return f"{name} is not in the manifest"
        try:
            read_progress(path)
            read_meta(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"progress.json/meta.json unreadable ({exc})"
    return None


# ------------------------------------------------------------------------------------------------ save
@dataclass
class SaveResult:
    path: Path
    release_upto: int  # rollouts below this are covered by every kept checkpoint: the store may drop them
    seconds_shards: float = 0.0
    seconds_total: float = 0.0
    bytes: int = 0


def save(
    root: str | Path,
    progress: TrainingProgress,
    *,
    group: Collectives,
    write_shards: Callable[[Path], None],
    state: Callable[[], dict[str, Any]],
    meta: dict[str, Any],
    attempt: int,
    keep: int,
    assets: Callable[[Path], None] | None = None,
    epoch: int = 0,
) -> SaveResult:
    """Collective save of a checkpoint at `progress` (every rank calls it; see the module docstring).

    `write_shards(dir)` writes the model/optimizer shards into `dir` (collective); `state()` gives rank 0's small
    state (scheduler, RNG) for state.pt; `assets(dir)`, if given, lets rank 0 add files to the checkpoint directory
    (e.g. the HF config and tokenizer a run started from; they are hashed with the rest). Raises `CheckpointFenced`
    on every rank when a newer attempt owns `root`.
    """
    import torch  # deferred: torch

    t0 = time.perf_counter()
    root = Path(root)
    name = step_name(progress.global_step)
    tmp = root / (f".tmp-{name}-a{attempt}" if epoch == 0 else f".tmp-{name}-e{epoch}-a{attempt}")
    final = root / name
    reason = None
    if group.rank == 0:
        reason = _fenced(fence_reason(root, attempt, f"commit {name}", epoch))
        if reason is None:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / DIST_DIR).mkdir(parents=True)
    _raise_any(group.gather_reasons(reason))
    t1 = time.perf_counter()
    # on a full volume rank 0 removes what was written, so the run's last lines (and its summary) still fit
    cleanup = (lambda: shutil.rmtree(tmp, ignore_errors=True)) if group.rank == 0 else None
    with _full_volume_raises(root, cleanup):
        write_shards(tmp / DIST_DIR)
    group.barrier()
    t2 = time.perf_counter()
    # Each rank hashes (and fsyncs) its share of the shard files; rank 0 collects the notes.
    shard_files = [f"{DIST_DIR}/{rel}" for rel in _listed_files(tmp / DIST_DIR)]
    with _full_volume_raises(root, cleanup):
        notes = {rel: digest(tmp / rel) for rel in _share(shard_files, group.rank, group.world)}
        (tmp / f"{_HASH_PREFIX}{group.rank}.json").write_text(json.dumps(notes))
    group.barrier()
    error = None
    total = 0
    release = progress.rollout
    if group.rank == 0:
        try:
            files: dict[str, Any] = {}
            for r in range(group.world):
                note = tmp / f"{_HASH_PREFIX}{r}.json"
                files.update(json.loads(note.read_text()))
                note.unlink()
            missing = sorted(set(shard_files) - set(files))
            if missing:
                raise CheckpointError(f"{tmp}: shard files without a hash: {missing[:5]}")
            torch.save(state(), tmp / "state.pt")
            if assets is not None:
                assets(tmp)
            _fsync_file(tmp / "meta.json", json.dumps({**meta, "attempt": attempt}, indent=1).encode())
            _fsync_file(tmp / "progress.json", json.dumps({**progress.to_dict(), "attempt": attempt}, indent=1).encode())
            for rel in _listed_files(tmp):
                files.setdefault(rel, digest(tmp / rel))
            _fsync_file(tmp / MARKER, json.dumps({"format": FORMAT, "attempt": attempt, "step": progress.global_step,
                                                  "files": files}, indent=1, sort_keys=True).encode())
            _fsync_dir(tmp / DIST_DIR)
            _fsync_dir(tmp)
            total = sum(f["size"] for f in files.values())
            reason = fence_reason(root, attempt, f"commit {name}", epoch)  # a newer attempt may have started meanwhile
            if reason is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointFenced(reason)
            trash = None
            if final.exists():  # the same step saved by an earlier attempt: swap it out
                trash = root / f".old-{name}-a{attempt}"
                if trash.exists():
                    shutil.rmtree(trash)
                final.rename(trash)
            tmp.rename(final)
            _fsync_dir(root)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
            prune(root, keep, attempt=attempt, epoch=epoch)
            release = release_point(root, default=progress.rollout)
        except CheckpointFenced as exc:
            error = _fenced(str(exc))
        except CheckpointError as exc:
            error = str(exc)
        except (OSError, RuntimeError) as exc:  # RuntimeError: torch.save's writer on a short write
            full = describe_no_space(exc, [root])
            if full:
                shutil.rmtree(tmp, ignore_errors=True)
            error = _NO_SPACE + full if full else f"{tmp}: cannot commit checkpoint {name}: {exc}"
    _raise_any(group.gather_reasons(error), root)
    release = group.broadcast_ints([release] if group.rank == 0 else None)[0]
    return SaveResult(final, release, seconds_shards=t2 - t1, seconds_total=time.perf_counter() - t0, bytes=total)


def _fenced(reason: str | None) -> str | None:
    return None if reason is None else _FENCED + reason


def _raise_any(reasons: list[str | None], root: Path | None = None) -> None:
    """Raise the first reason given by any rank (on every rank): CheckpointFenced for a fencing refusal, the
    full-volume OSError (`_full_volume_raises`) when the checkpoint's volume is full."""
    for reason in reasons:
        if reason is not None:
            if reason.startswith(_FENCED):
                raise CheckpointFenced(reason[len(_FENCED):])
            if reason.startswith(_NO_SPACE):
                raise OSError(errno.ENOSPC, reason[len(_NO_SPACE):], str(root))
            raise CheckpointError(reason)


@contextmanager
def _full_volume_raises(root: Path, cleanup: Callable[[], None] | None = None):
    """A write of this rank that fails because the checkpoints' volume is full — whatever the writer made of the
    OSError (torch's checkpoint writer gathers it to one rank as text; its zip writer reports a short write as a
    RuntimeError; a peer only learns that the save failed) — raises `OSError(ENOSPC)` naming the checkpoint root,
    so every rank reports it as one line and exits 78 (`trainer/main.py`), whichever rank found the volume full
    first (`cleanup` then removes the partial checkpoint). Other failures pass unchanged."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised unless the volume is full
        line = describe_no_space(exc, [root])
        if line is None:
            raise
        if cleanup is not None:
            cleanup()
        raise OSError(errno.ENOSPC, line, str(root)) from exc


def release_point(root: str | Path, *, default: int) -> int:
    """The rollout of the oldest complete checkpoint under `root` (`default` if none): rollouts below it may be
    dropped from the store, every checkpoint a resume may fall back to still finds its data there."""
    rollouts = []
    for d in complete_checkpoints(root):
        try:
            rollouts.append(read_progress(d).rollout)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # an unreadable one will be skipped by resume anyway
    return min(rollouts, default=default)


def prune(root: str | Path, keep: int, *, attempt: int | None = None, epoch: int = 0) -> list[Path]:
    """Keep the `keep` newest complete checkpoints; remove older ones and leftovers of interrupted saves.
    Returns the kept ones (oldest first). With `attempt`, refuses (`CheckpointFenced`) when a newer attempt owns
    `root`, and leaves the temporary directories of newer attempts alone."""
    root = Path(root)
    if attempt is not None:
        reason = fence_reason(root, attempt, "prune", epoch)
        if reason is not None:
            raise CheckpointFenced(reason)
    complete = complete_checkpoints(root)
    cut = max(len(complete) - keep, 0)
    for d in complete[:cut]:
        shutil.rmtree(d, ignore_errors=True)
    newest = complete[-1].name if complete else None
    for d in root.iterdir():
        if d.name.startswith((".tmp-", ".old-")) and d.is_dir():
            m = re.search(r"(?:-e(\d+))?-a(\d+)$", d.name)
            if attempt is not None and m and (int(m.group(1) or 0), int(m.group(2))) > (epoch, attempt):
                continue
            shutil.rmtree(d, ignore_errors=True)
        elif step_of(d) is not None and d.is_dir() and not (d / MARKER).is_file() and d.name != newest:
            shutil.rmtree(d, ignore_errors=True)
    return complete[cut:]


# ------------------------------------------------------------------------------------------------ resume
@dataclass
class Resumed:
    path: Path
    progress: TrainingProgress
    state: dict[str, Any]
    meta: dict[str, Any]
    skipped: list[tuple[Path, str]]  # newer checkpoints that could not be loaded, and why


def resume(
    root: str | Path,
    *,
    group: Collectives,
    load_shards: Callable[[Path], None],
    attempt: int,
    log: Callable[[str], None] = lambda _m: None,
    epoch: int = 0,
) -> Resumed | None:
    """Load the newest loadable checkpoint under `root` (collective); None when there is none at all.

    Records `attempt` in the fence first (rank 0). `load_shards(dir)` loads model and optimizer from a dist
    directory (collective; it raises on any rank → that checkpoint is skipped on every rank). Raises
    `CheckpointFenced` for an older attempt, `CheckpointError` when checkpoints exist and none can be loaded.
    """
    import torch  # deferred: torch

    root = Path(root)
    reason = None
    steps: list[int] | None = None
    if group.rank == 0:
        reason = fence_reason(root, attempt, "resume", epoch)
        if reason is not None:
            reason = _fenced(reason + "; if this is a new run that reuses the directory on purpose, give it another "
                             f"trainer.checkpoint.path or remove {(root / FENCE_DIR).resolve()}")
        else:
            newest = newest_fence(root)
            if newest is not None and newest[0] < epoch:
                log(f"{root.resolve()}: taking the checkpoints over from the run created {_describe_epoch(newest[0])}"
                    f" (its attempt {newest[1]}); that run's leftovers are fenced off")
            record_attempt(root, attempt, epoch)
            steps = [int(step_of(d)) for d in reversed(complete_checkpoints(root))]  # type: ignore[arg-type]
    _raise_any(group.gather_reasons(reason))
    steps = group.broadcast_ints(steps)
    if not steps:
        return None
    skipped: list[tuple[Path, str]] = []
    for step in steps:
        path = root / step_name(step)
        reasons = group.gather_reasons(verify(path, rank=group.rank, world=group.world))
        why = _describe(reasons)
        loaded: Resumed | None = None
        if why is None:
            error = None
            try:
                load_shards(path / DIST_DIR)
                state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
                loaded = Resumed(path, read_progress(path), state, read_meta(path), skipped)
            except Exception as exc:  # noqa: BLE001 - any failure to load makes this checkpoint unusable
                error = f"loading failed: {exc.__class__.__name__}: {str(exc)[:400]}"
            why = _describe(group.gather_reasons(error))
        if why is None and loaded is not None:
            if skipped and group.rank == 0:
                for bad, _ in skipped:
                    _quarantine(bad, attempt, log)
            return loaded
        log(f"checkpoint {path} cannot be loaded: {why}" + ("; trying the previous one" if step != steps[-1] else ""))
        skipped.append((path, why))
    listing = "; ".join(f"{p}: {w}" for p, w in skipped)
    raise CheckpointError(f"no checkpoint in {root.resolve()} can be loaded ({listing}); restore a good checkpoint "
                          "there, or remove the directory to start the run from scratch (with a fresh store)")


def _describe(reasons: list[str | None]) -> str | None:
    bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
    if not bad:
        return None
    seen: list[str] = []
    for _, why in bad:
        if why not in seen:
            seen.append(why)
    ranks = ",".join(str(r) for r, _ in bad)
    return f"{'; '.join(seen)} (found by rank {ranks})" if len(reasons) > 1 else seen[0]


def _quarantine(path: Path, attempt: int, log: Callable[[str], None]) -> None:
    target = path.with_name(f"{path.name}.unloadable-a{attempt}")
    try:
        path.rename(target)
        log(f"renamed the unloadable {path} to {target.name} (kept for inspection; delete it when done)")
    except OSError as exc:
        log(f"warning: cannot rename the unloadable {path}: {exc}")


# ------------------------------------------------------------------------------------------------ one process
def read_tensors(path: str | Path, *, model_only: bool = False) -> dict[str, Any]:
    """Every tensor of a verified checkpoint at full (tensor-parallel-gathered) shape, in this process and without
    torch.distributed: {Megatron's sharded key: tensor}. Model keys are the GPT model's (layers stacked along a first
    axis: `decoder.layers.<name>` [num_layers, ...]; `model_tensors` unstacks them), optimizer keys start with
    `optimizer.` (`optimizer.state.exp_avg.<model key>`, ...), or `chained_<i>.optimizer.` for a mixture of experts'
    dense and expert optimizers (Megatron's `ChainedOptimizer`). CheckpointError naming the path and why if the
    checkpoint does not verify."""
    import torch  # deferred: torch
    from torch.distributed.checkpoint import FileSystemReader  # deferred: torch
    from torch.distributed.checkpoint import load as dcp_load  # deferred: torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # deferred: torch

    path = Path(path)
    why = verify(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {why}")
    reader = FileSystemReader(str(path / DIST_DIR))
    out = {k: torch.empty(md.size, dtype=md.properties.dtype)
           for k, md in reader.read_metadata().state_dict_metadata.items()
           if isinstance(md, TensorStorageMetadata) and not (model_only and _OPTIMIZER_KEY.match(k))}
    dcp_load(out, storage_reader=reader, no_dist=True)
    return out


def model_tensors(path: str | Path) -> dict[str, Any]:
    """The model's tensors of a checkpoint at full shape, one entry per layer (`decoder.layers.<i>.<name>`), named as
    Megatron's sharded state dict names them (TransformerEngine-style names, e.g. `linear_qkv.layer_norm_weight`,
    whichever layer spec wrote it); a mixture of experts' layers are stored per layer, their experts stacked
    (`mlp.experts.experts.linear_fc1.weight` [E, ...] → `mlp.experts.local_experts.<e>.linear_fc1.weight`; their LoRA
    adapters `….linear_fc1.adapter.gate_up_A` alike)."""
    out = {}
    for key, t in read_tensors(path, model_only=True).items():
        experts = _EXPERTS_KEY.match(key)
        if experts:  # a mixture of experts' layer: its experts stacked along a first axis, numbered globally
            for e in range(t.shape[0]):
                out[f"{experts.group(1)}.local_experts.{e}.{experts.group(2)}"] = t[e].clone()
        elif key.startswith("decoder.layers.") and not key[len("decoder.layers."):][:1].isdigit():
            rest = key[len("decoder.layers."):]
            for i in range(t.shape[0]):
                out[f"decoder.layers.{i}.{rest}"] = t[i].clone()
        else:  # per layer already (the layers of a mixture of experts)
            out[key] = t
    return out


_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
_EXPERTS_KEY = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.experts\."
                          r"(linear_fc[12]\.(?:weight|bias|adapter\.\w+))$")  # the experts' LoRA adapters too


def rng_state() -> dict[str, Any]:
    """Rank 0's generators for state.pt (kept for older readers; a resume takes each rank's own: `trainer.rng`)."""
    import torch  # deferred: torch

    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state

