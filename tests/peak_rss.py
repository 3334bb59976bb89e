"""A child-command prefix that records each child's peak resident memory: `trainingrun run` with
TRAININGRUN_CHILD_COMMAND="python tests/peak_rss.py" starts every child (rollout, trainers) as
`python tests/peak_rss.py ROLE ARGS...`, which runs `python -m trainingrun ROLE ARGS...`, forwards SIGTERM/SIGINT,
reaps it with wait4 and appends {"role", "pid", "rank", "peak_rss"} (rank: the child's $RANK, None unset; bytes: the kernel's ru_maxrss of that child, its VmHWM at
exit) to the file named by $TRAININGRUN_PEAK_FILE, then exits with the child's status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from trainingrun.childproc import DIE_WITH_PARENT


def main() -> int:
    child = subprocess.Popen([sys.executable, "-m", "trainingrun", *sys.argv[1:]], preexec_fn=DIE_WITH_PARENT)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda n, _frame: child.send_signal(n))
    while True:
        try:
            _, status, usage = os.wait4(child.pid, 0)
            break
        except InterruptedError:
            continue
    with open(os.environ["TRAININGRUN_PEAK_FILE"], "a") as out:
        out.write(json.dumps({"role": sys.argv[1] if len(sys.argv) > 1 else "", "pid": child.pid,
                              "rank": os.environ.get("RANK"),
                              "peak_rss": usage.ru_maxrss * 1024}) + "\n")
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    raise SystemExit(main())
