"""The services a run uses: the shared store between rollout and trainers (`spec.store`) and metrics with
experiment tracking (`spec.metrics`: Prometheus, TensorBoard, Weights & Biases)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainingrun.api.spec.base import ApiModel, ResourceRequirements, Rule


class StoreSpec(ApiModel):
    """The shared store between rollout and trainers."""

    CEL_RULES = (Rule(name="url-or-managed", rule="!(has(self.url) && self.managed)",
                      message="set store.url or store.managed, not both"),)

    url: str | None = Field(
        None,
        pattern=r"^(file|redis)://.+",
        description="file:///path or redis://host:port/db. Unset: a file store in the run directory (local runs).",
    )
    managed: bool = Field(False, description="The operator runs a Redis pod and service for this run.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Resources of the managed Redis pod; empty: requests cpu 250m, memory 2Gi and limit memory 2Gi "
        "(size it for maxPendingRollouts + 1 rollouts of payload).",
    )

    @model_validator(mode="after")
    def _rules(self) -> StoreSpec:
        if self.url is not None and self.managed:
            raise ValueError(self.cel_rule("url-or-managed").message)
        return self


class TensorBoardSpec(ApiModel):
    """TensorBoard event files written by trainer rank 0, one scalar per numeric field of the step record."""

    enabled: bool = Field(True, description="Write event files.")
    path: str | None = Field(
        None, min_length=1,
        description="Directory of the event files; relative paths are inside the output directory (a local run's "
                    "directory, in a cluster trainer.checkpoint.path). Unset: <output directory>/tensorboard.",
    )


class SecretKeySelector(ApiModel):
    """A key of a Secret in the run's namespace."""

    name: str = Field(..., min_length=1, max_length=253, description="Secret name.")
    key: str = Field("api-key", min_length=1, max_length=253, description="Key in the Secret.")


class WandbSpec(ApiModel):
    """Weights & Biases logging from trainer rank 0 (the same per-step fields as TensorBoard). The run id is kept
    with the checkpoints, so a restarted or resumed run continues the same W&B run. Online mode needs
    WANDB_API_KEY in the trainers' environment."""

    project: str = Field(..., min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, min_length=1, description="W&B entity (user or team); unset: your default.")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: stream to W&B; offline: write files under <output directory>/wandb for "
                              "`wandb sync` later."
    )
    name: str | None = Field(None, min_length=1, description="Display name (default: metadata.name).")
    group: str | None = Field(None, min_length=1, description="W&B group.")
    tags: list[str] = Field(default_factory=list, max_length=64, description="W&B tags.")
    api_key_secret: SecretKeySelector | None = Field(
        None, description="Secret holding the W&B API key, given to the trainer pods as WANDB_API_KEY (online mode "
                          "in a cluster). Local runs use the launcher's environment."
    )


class MetricsSpec(ApiModel):
    """Prometheus metrics served by every trainer and the rollout pod, and experiment tracking by step."""

    enabled: bool = Field(True, description="Serve /metrics.")
    port: int = Field(9400, ge=1, le=65535, description="Port of /metrics (local runs use port, port+1, ...).")
    linger_seconds: int = Field(
        0, ge=0, le=3600,
        description="Trainers (after the last step) and the rollout (after the last rollout) keep serving /metrics "
                    "this long, so a scrape sees their final values.",
    )
    tensorboard: TensorBoardSpec = Field(default_factory=TensorBoardSpec, description="TensorBoard event files.")
    wandb: WandbSpec | None = Field(None, description="Weights & Biases logging (off when unset).")
