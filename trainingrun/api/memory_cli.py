"""`trainingrun plan FILE`: the memory plan of a TrainingRun, per role and per GPU (per process on a CPU).

Loads the manifest through the one loader, except that a plan that does not fit is what this command shows rather
than an error; then prints, for each role (the trainers; the run's own vLLM servers), every term of
`trainingrun.modeling.memory` in GiB with how it was counted, the total against the role's budget
(spec.trainer.gpuMemoryGiB, spec.rollout.engine.vllm.gpuMemoryGiB) and whether it fits. `--json` prints the same as
one JSON object. `--hf-config DIR` plans a `model.hf` model whose directory is not on this machine from a directory
holding its config.json. CPU roles have no budget: the command prints what a local run's processes add up to beside
this machine's memory.

Exit 0 when the plan fits (or nothing is checked: CPUs), 78 when a role does not fit (as `trainingrun validate`),
1 when the manifest is not a valid TrainingRun or its model cannot be resolved here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from trainingrun.api.manifest import problem_lines, select_trainingrun
from trainingrun.api.memory import spec_plan
from trainingrun.api.models import TrainingRun, parse_trainingrun
from trainingrun.api.yamlcodec import ManifestError, parse_yaml, read_text
from trainingrun.contract.errors import EXIT_CONFIG_ERROR
from trainingrun.modeling.memory import GIB, MemoryPlan, RolePlan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="TrainingRun YAML file ('-' reads standard input)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--hf-config", metavar="DIR",
                        help="a directory with the config.json of model.hf, when that directory is not on this machine")


def load(path: str) -> TrainingRun:
    """The run of `path`, refused (ManifestError) for any error but a memory plan that does not fit."""
    doc = select_trainingrun(parse_yaml(read_text(path), path), path)
    errors = [line for kind, line in problem_lines(doc) if kind != "memory"]
    if errors:
        raise ManifestError(errors)
    return parse_trainingrun(doc.value)


def machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def _role_header(role: RolePlan, run: TrainingRun) -> str:
    ts, spec = run.spec.trainer, run.spec
    if role.role == "trainer":
        parallel = (f"TP {ts.tensor_parallel_size}, PP {ts.pipeline_parallel_size}, EP {ts.expert_parallel_size}, "
                    f"DP {ts.data_parallel_size}")
        where = (f"{role.count} GPU(s) ({ts.replicas} pod(s) × {ts.gpus_per_replica})" if ts.gpus_per_replica
                 else f"{role.count} CPU process(es)")
        return f"trainer: {where}, {parallel}"
    e = spec.rollout.engine
    where = (f"{role.count} GPU(s) ({e.replicas} server(s) × {e.vllm.gpus})" if e.vllm.gpus
             else f"{e.replicas} CPU server(s)")
    return f"engine: {where}, vLLM {e.vllm.dtype}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def render(plan: MemoryPlan, run: TrainingRun, source: str) -> str:
    arch_line = f"{source}: {_count(plan.parameters)} parameters, {run.spec.model.precision}"
    lines = [arch_line]
    for role in plan.roles:
        lines += ["", _role_header(role, run) + (f" — {role.note}" if role.note else "")]
        lines.append(f"  {'per ' + role.unit:<22}{'GiB':>9}  how")
        for term in role.terms:
            lines.append(f"  {term.label:<22}{term.gib:9.2f}  {term.detail}")
        if role.budget is None:
            lines.append(f"  {'total':<22}{role.total / GIB:9.2f}  no budget on a CPU (not checked)")
        else:
            verdict = "fits" if role.fits else "DOES NOT FIT"
            lines.append(f"  {'total':<22}{role.total / GIB:9.2f}  of {role.budget / GIB:.2f} "
                         f"({role.budget_field}): {verdict}")
            if role.limit is not None:
                need = sum(t.bytes for t in role.within_limit)
                lines.append(f"  {'':<22}{'':>9}  vLLM's share {role.limit / GIB:.2f} GiB ({role.note}) holds "
                             f"{need / GIB:.2f} GiB of weights, runtime and one sequence's KV cache")
        if role.fits is False:
            lines.append(f"  {role.budget_field}: {role.problem()}")
    cpu = [r for r in plan.roles if r.budget is None]
    if cpu:
        total = sum(r.total * r.count for r in cpu)
        mem = machine_memory()
        lines += ["", f"CPU processes of a local run: {total / GIB:.2f} GiB together (the rollout process not counted)"
                  + (f"; this machine has {mem / GIB:.2f} GiB" if mem else "")]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        tr = load(args.file)
    except ManifestError as exc:
        for line in exc.lines:
            print(line, file=sys.stderr)
        return 1
    plan = spec_plan(tr, hf_config=args.hf_config)
    if plan is None:
        if tr.spec.model.hf is not None:
            print(f"{args.file}: spec.model.hf: cannot plan {tr.spec.model.hf!r} here: its config.json is not "
                  "readable (or not a model this trainer builds); pass --hf-config DIR (a directory holding that "
                  "model's config.json)", file=sys.stderr)
        else:
            print(f"{args.file}: spec.model: the model does not resolve", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"file": args.file, **plan.to_dict()}, indent=1))
    else:
        print(render(plan, tr, args.file))
    return EXIT_CONFIG_ERROR if plan.fits is False else 0
