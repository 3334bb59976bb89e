"""What a schema-valid TrainingRun needs to run in a cluster, beyond the CRD's own schema and CEL rules (which the API
server enforces at admission, `trainingrun.api.checks`): names that make DNS labels, a model the spec can resolve
without its HF directory, podTemplate volumes and mounts that leave the operator's own alone, and a store that pods
can share. `status.decide` fails a run with these errors (InvalidSpec) before creating anything.

`memory_errors`: a memory plan that does not fit the GPUs the run names (`api.memory`, what `trainingrun plan`
prints), checked by `status.decide` for a new run only, before its first pods — a run already running (created by an
older operator, or whose figures proved fine) is never failed by an estimate. A `model.hf` model is planned by its
trainers at start-up instead (exit 78 naming the same terms), where its config.json is. Pure.
"""

from __future__ import annotations

import re

from trainingrun.api.memory import plan_problems
from trainingrun.api.models import TrainingRun
from trainingrun.operator.vocabulary import CONFIG_VOLUME, SHM_VOLUME, Names
from trainingrun.plan import CONFIG_MOUNT_PATH

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def cluster_errors(run: TrainingRun) -> list[str]:
    """What is wrong with a schema-valid run for running in a cluster: one message per problem, naming the field,
    what was wrong and what is allowed. Empty when the run can be rendered."""
    errors: list[str] = []
    names = Names(run.metadata.name)
    for what, value in (("service", names.service), ("store service", names.store), ("engine service", names.engine)):
        if len(value) > 63 or not _DNS_LABEL.match(value):
            errors.append(
                f"metadata.name: {run.metadata.name!r} gives the {what} name {value!r}, which must be a DNS label "
                f"(at most 63 characters, starting with a letter); use a name of at most {63 - len(value) + len(run.metadata.name)} "
                "characters that starts with a letter"
            )
    try:
        run.spec.model.resolved(read_hf=False)  # the HF directory is on the pods' volume, not here
    except (ValueError, KeyError) as exc:
        errors.append(f"spec.model: {exc} (after applying preset {run.spec.model.preset!r})")
    config_dir = CONFIG_MOUNT_PATH.rsplit("/", 1)[0]
    for i, volume in enumerate(run.spec.pod_template.volumes):
        if volume.get("name") in (CONFIG_VOLUME, SHM_VOLUME):
            errors.append(f"spec.podTemplate.volumes[{i}].name: {volume.get('name')!r} is one of the operator's own "
                          f"volumes ({CONFIG_VOLUME!r}: the run's ConfigMap, {SHM_VOLUME!r}: /dev/shm); use another name")
    for i, mount in enumerate(run.spec.pod_template.volume_mounts):
        if str(mount.get("mountPath", "")).rstrip("/") == config_dir:
            errors.append(f"spec.podTemplate.volumeMounts[{i}].mountPath: {config_dir!r} is where the operator mounts "
                          "the run's manifest; use another path")
    url = run.spec.store.url
    if url is not None and url.startswith("file://"):
        errors.append(
            f"spec.store.url: {url!r} is a file store, which pods cannot share in a cluster; "
            "use a redis:// URL or store.managed: true"
        )
    return errors


def memory_errors(run: TrainingRun) -> list[str]:
    """One message per role whose memory plan does not fit its GPUs (the budget field, the role, the terms that
    overflow and the fields to change); empty when it fits, on CPUs, or for a `model.hf` model (not readable here)."""
    return [f"{field}: {message}" for field, message in plan_problems(run, read_hf=False)]
