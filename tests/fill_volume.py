"""A child command for the full-volume tests (`TRAININGRUN_CHILD_COMMAND="python tests/fill_volume.py"`).

It runs `trainingrun ARGS` unchanged, except in the trainer process whose RANK is $FILL_RANK: there, at one chosen
point of that rank's checkpoint save, it fills the volume holding $FILL_VOLUME (a file `late-filler` there taking all
but $FILL_LEAVE bytes), so which rank finds the volume full first, and in which writer, is decided by the test rather
than raced for:

  FILL_AT=shards   right before this rank's model/optimizer shards are written (Megatron's dist_checkpointing over
                   torch's checkpoint writer: every rank's write fails, the writer gathers the errors to one rank,
                   as text, and raises its `CheckpointException` on all of them)
  FILL_AT=commit   rank 0: right before it writes state.pt (torch's zip writer) in the commit of the checkpoint

It fills at the save after $FILL_AFTER completed ones (so a checkpoint exists to resume from). The other processes
(the rollout, the other ranks) run unchanged and meet the full volume wherever they next write.
"""

from __future__ import annotations

import os
import sys

FILLER = "late-filler"


def fill() -> None:
    volume = os.environ["FILL_VOLUME"]
    st = os.statvfs(volume)
    size = st.f_bavail * st.f_frsize - int(os.environ.get("FILL_LEAVE", "65536"))
    if size > 0:
        fd = os.open(os.path.join(volume, FILLER), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)


def install(where: str, after: int) -> None:
    from trainingrun.trainer import checkpoint, checkpoint_megatron  # deferred: after the argument check

    calls = {"n": 0}

    def at_call(real):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == after + 1:
                fill()
            return real(*args, **kwargs)
        return wrapped

    if where == "shards":  # looked up by name at every save (TrainerCheckpoints.save)
        checkpoint_megatron.write_shards = at_call(checkpoint_megatron.write_shards)
    elif where == "commit":  # rank 0's state.pt holds the RNG state: taken right before torch.save writes it
        checkpoint.rng_state = at_call(checkpoint.rng_state)
    else:
        raise SystemExit(f"FILL_AT: {where!r} is not shards or commit")


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["trainer"] and os.environ.get("RANK") == os.environ.get("FILL_RANK"):
        install(os.environ["FILL_AT"], int(os.environ.get("FILL_AFTER", "1")))
    from trainingrun.cli import main as cli_main

    return cli_main(args)


# Guarded like trainingrun/__main__.py: Megatron's checkpoint writer spawns a helper that imports the main module.
if __name__ == "__main__":
    raise SystemExit(main())
