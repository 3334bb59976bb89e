"""`trainingrun schedule LENGTHS ...`: print a data-parallel schedule's per-step statistics as a table.

LENGTHS (and ``--groups``) is a file of values, or ``-`` for standard input: a JSON list (or an object with a
``lengths`` / ``group_ids`` list), JSON Lines (one value, or one list of values, per line), or plain text (values
separated by whitespace or commas). ``--json`` prints the statistics, the totals and the schedule itself (each rank's
sample indices per micro-batch) as one JSON object instead of the table. Samples longer than ``--max-tokens`` each get
a micro-batch of their own above the cap: a warning on stderr says how many (and ``warnings`` in ``--json``).
Bad input prints one line ``trainingrun schedule: error: <argument>: <reason>`` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from .dp_schedule import build_dp_schedule
from .stats import schedule_stats

EXIT_USAGE = 2

# build_dp_schedule's argument names -> the flags that set them, so errors name what the user typed.
_FLAGS = {
    "lengths": "LENGTHS",
    "dp_size": "--dp",
    "global_batch_size": "--global-batch-size",
    "group_ids": "--groups",
    "max_tokens_per_gpu": "--max-tokens",
    "micro_batch_size": "--micro-batch-size",
    "microbatch_multiple": "--microbatch-multiple",
    "cost": "--cost",
}


class _UsageError(Exception):
    """A one-line usage error; the message starts with the argument's name."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


COLUMNS_HELP = """\
columns of the table (one row per step; --json gives the same fields by their long names):
  step           step index within these lengths (0-based)
  gbs            global batch size: samples in the step, over all ranks
  mb/rank        micro-batches every rank runs in the step (the same on every rank)
  lower bd       lower bound on mb/rank for these samples (token cap or micro-batch size, per rank)
  max rank tok   tokens of the most loaded rank in the step
  mean rank tok  mean tokens per rank in the step
  tok imb        token imbalance: max rank tokens / mean rank tokens (1 = balanced)
  flops imb      the same for the FLOPs proxy a*L + L^2 per sample of length L
  fill           step tokens / (micro-batches x ranks x --max-tokens): how full the micro-batches are
                 (- with static --micro-batch-size)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the sub-command's arguments on ``parser`` (and make its errors one line, exit code 2)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = COLUMNS_HELP
    parser.add_argument("lengths", metavar="LENGTHS",
                        help="file of sample lengths in tokens (JSON, JSONL or text); - reads standard input")
    parser.add_argument("--dp", type=_positive_int, default=1, metavar="N", help="data-parallel ranks (default 1)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--max-tokens", type=_positive_int, metavar="C", help="dynamic micro-batches: token cap per GPU")
    mode.add_argument("--micro-batch-size", type=_positive_int, metavar="M", help="static micro-batches of ≤ M samples")
    parser.add_argument("--global-batch-size", type=_positive_int, metavar="G",
                        help="groups per step (default: all groups in one step)")
    parser.add_argument("--groups", metavar="FILE", help="file of group ids, one per sample (default: one group each)")
    parser.add_argument("--microbatch-multiple", type=_positive_int, default=1, metavar="K",
                        help="micro-batches per rank must be a multiple of K (virtual pipeline stages)")
    parser.add_argument("--cost", choices=("tokens", "flops"), default="tokens",
                        help="load balanced across ranks (default tokens)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (steps, totals, warnings, the schedule) instead of the table")

    def one_line_error(message: str) -> NoReturn:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    parser.error = one_line_error  # type: ignore[method-assign]


def run(args: argparse.Namespace) -> int:
    """Build the schedule and print its table; 0 on success, 2 on bad input (one line on stderr)."""
    try:
        return _run(args)
    except _UsageError as exc:
        print(f"trainingrun schedule: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    if args.max_tokens is None and args.micro_batch_size is None:
        raise _UsageError("--max-tokens: give one of --max-tokens (dynamic) or --micro-batch-size (static)")
    lengths = _read_values(args.lengths, "LENGTHS", key="lengths")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in lengths):
        raise _UsageError("LENGTHS: every value must be an integer")
    groups = None if args.groups is None else _read_values(args.groups, "--groups", key="group_ids")
    try:
        schedule = build_dp_schedule(
            lengths, dp_size=args.dp, global_batch_size=args.global_batch_size, group_ids=groups,
            max_tokens_per_gpu=args.max_tokens, micro_batch_size=args.micro_batch_size,
            microbatch_multiple=args.microbatch_multiple, cost=args.cost)
    except ValueError as exc:
        raise _UsageError(_flag_message(str(exc))) from None
    stats = schedule_stats(schedule, lengths, cost=args.cost)
    placed = sum(schedule.global_batch_sizes)
    warnings = []
    if args.max_tokens is not None:
        over = [n for n in lengths if n > args.max_tokens]
        if over:
            warnings.append(f"{len(over)} of {len(lengths)} samples are longer than --max-tokens {args.max_tokens} "
                            f"(longest {max(over)}): each runs as a micro-batch of its own above the cap")
    for w in warnings:
        print(f"trainingrun schedule: warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "steps": stats,
            "num_steps": schedule.num_steps,
            "samples_scheduled": placed,
            "leftover": list(schedule.leftover),
            "dp_size": schedule.dp_size,
            "warnings": warnings,
            "schedule": {
                "num_microbatches": list(schedule.num_microbatches),
                "global_batch_sizes": list(schedule.global_batch_sizes),
                "partitions": [list(p) for p in schedule.partitions],
                "micro_batch_indices": [[list(mb) for mb in ranks] for ranks in schedule.micro_batch_indices],
            },
        }, default=_json_default))
        return 0
    print(format_table(stats))
    print(f"{schedule.num_steps} steps, {placed} samples scheduled, {len(schedule.leftover)} leftover, "
          f"dp {schedule.dp_size}")
    return 0


def _json_default(value: Any) -> Any:
    """numpy scalars (the schedule's indices) as plain numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _flag_message(message: str) -> str:
    """Rename a leading ``argument_name:`` to the CLI flag that sets it."""
    name, sep, rest = message.partition(":")
    return f"{_FLAGS[name]}:{rest}" if sep and name in _FLAGS else message


# ------------------------------------------------------------------------------------------------------------ input


def _read_values(path: str, name: str, *, key: str) -> list[Any]:
    """Values from a JSON / JSONL / text file; ``_UsageError`` naming ``name`` if unreadable or malformed."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise _UsageError(f"{name}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    else:
        if isinstance(data, dict) and isinstance(data.get(key), list):
            data = data[key]
        if not isinstance(data, list):
            data = [data]
        return _flat(data, name)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    try:
        values = [json.loads(ln) for ln in lines]
    except ValueError:
        return [_scalar(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]
    return _flat(values, name)


def _flat(values: list[Any], name: str) -> list[Any]:
    out: list[Any] = []
    for v in values:
        items = v if isinstance(v, list) else [v]
        for item in items:
            if isinstance(item, (dict, list)) or item is None:
                raise _UsageError(f"{name}: expected numbers or strings, got {json.dumps(item)[:40]}")
            out.append(item)
    return out


def _scalar(token: str) -> int | str:
    try:
        return int(token)
    except ValueError:
        return token


# ----------------------------------------------------------------------------------------------------------- output

_COLUMNS = [
    ("step", "step", "{}"),
    ("gbs", "global_batch_size", "{}"),
    ("mb/rank", "microbatches_per_rank", "{}"),
    ("lower bd", "lower_bound_microbatches", "{}"),
    ("max rank tok", "max_rank_tokens", "{}"),
    ("mean rank tok", "mean_rank_tokens", "{:.1f}"),
    ("tok imb", "token_imbalance", "{:.4f}"),
    ("flops imb", "flops_imbalance", "{:.4f}"),
    ("fill", "fill_ratio", "{:.4f}"),
]


def format_table(stats: list[dict[str, Any]]) -> str:
    """A fixed-width table of :func:`~trainingrun.schedule.schedule_stats` rows (``-`` for None)."""
    rows = [[("-" if s[key] is None else fmt.format(s[key])) for _, key, fmt in _COLUMNS] for s in stats]
    widths = [max([len(title)] + [len(r[i]) for r in rows]) for i, (title, _, _) in enumerate(_COLUMNS)]
    lines = ["  ".join(title.rjust(w) for (title, _, _), w in zip(_COLUMNS, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
