"""The base of every API model: `ApiModel` (camelCase fields, unknown fields refused, its cross-field rules as CEL
in `CEL_RULES`, each a named `Rule`, found by its Python twin through `cel_rule(name)`), the bounds every number of
the API keeps, and the types several sections share (`Quantity`, `ResourceRequirements`)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


# A Kubernetes resource quantity ("500m", "2Gi", 4). The CRD marks it x-kubernetes-int-or-string.
Quantity = int | str

# Every number of the API has bounds (a test walks the CRD schema to keep it so): a manifest cannot carry a value
# that some later computation overflows (a seed of 1e29, a clip threshold of 1e309).
INT64_MAX = 2**63 - 1
MAX_SEED = 2**32 - 1  # numpy's and torch's seeding accept it on every platform
MAX_SAMPLES = 2**53  # sample counts pass through float64 (LR schedule): exact up to 2^53
MAX_SECONDS = 2**31 - 1  # durations in seconds (~68 years)
MAX_TOKENS = 2**31 - 1  # token counts (token ids and offsets of one rank's payload are int32/int64)
MAX_LENGTH = 1_048_576  # sample length in tokens (= the largest model.seqLength)
MAX_SAMPLES_PER_ROLLOUT = 10_000_000


class Rule(BaseModel):
    """One cross-field rule: a CEL expression over `self` (the object it is attached to) and its message. `name`
    (unique within its model, not part of the CRD) is how the rule's Python twin and its test find it."""

    name: str
    rule: str
    message: str
    fieldPath: str | None = None  # noqa: N815 - Kubernetes' own name


class ApiModel(BaseModel):
    """Base: camelCase field names, unknown fields rejected, validated on assignment."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        allow_inf_nan=False,
    )
    # CEL rules attached to this object in the CRD (x-kubernetes-validations). Python twins: model validators, which
    # raise `ValueError(cls.cel_rule(name).message)`.
    CEL_RULES: ClassVar[tuple[Rule, ...]] = ()

    @classmethod
    def cel_rule(cls, name: str) -> Rule:
        """This model's CEL rule called `name`."""
        for rule in cls.CEL_RULES:
            if rule.name == name:
                return rule
        raise KeyError(f"{cls.__name__} has no CEL rule {name!r}; it has {[r.name for r in cls.CEL_RULES]}")

    def to_dict(self) -> dict[str, Any]:
        """The object as the API server would store it: camelCase, defaults filled in, unset optionals omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ResourceRequirements(ApiModel):
    """Compute resources of a container, as in a Pod spec."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Minimum resources, e.g. cpu: 2.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Maximum resources, e.g. memory: 8Gi.")


MAX_RESOURCE_CLAIMS = 16


class PodResourceClaim(ApiModel):
    """A device a pod claims through dynamic resource allocation (core/v1 PodResourceClaim, Kubernetes 1.34+): a
    ResourceClaim the pod shares (`resourceClaimName`) or one made for the pod from a template
    (`resourceClaimTemplateName`). The pod's main container claims it (`resources.claims`)."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                      description="The claim's name within the pod (a DNS label).")
    resource_claim_name: str | None = Field(None, min_length=1, max_length=253,
                                            description="An existing ResourceClaim in the run's namespace.")
    resource_claim_template_name: str | None = Field(
        None, min_length=1, max_length=253,
        description="A ResourceClaimTemplate in the run's namespace: each pod gets its own claim made from it.")

    def as_pod_claim(self) -> dict[str, str]:
        source = ("resourceClaimName", self.resource_claim_name) if self.resource_claim_name is not None else \
            ("resourceClaimTemplateName", self.resource_claim_template_name)
        return {"name": self.name, source[0]: str(source[1])}


# Attached to each object with a resourceClaims list (trainer, rollout.engine.vllm); `check_claims` is its twin.
CLAIMS_RULE = Rule(
    name="resource-claims-named-once-with-one-source",
    rule="!has(self.resourceClaims) || self.resourceClaims.all(c, "
         "has(c.resourceClaimName) != has(c.resourceClaimTemplateName) && "
         "self.resourceClaims.filter(d, d.name == c.name).size() == 1)",
    message="resourceClaims: every claim needs a name of its own and exactly one of resourceClaimName and "
            "resourceClaimTemplateName",
    fieldPath=".resourceClaims",
)


def check_claims(claims: list[PodResourceClaim]) -> None:
    """The Python twin of CLAIMS_RULE, naming the claim that breaks it."""
    seen: set[str] = set()
    for c in claims:
        if (c.resource_claim_name is None) == (c.resource_claim_template_name is None):
            raise ValueError(f"{CLAIMS_RULE.message} (claim {c.name!r} has "
                             f"{'both' if c.resource_claim_name is not None else 'neither'})")
        if c.name in seen:
            raise ValueError(f"{CLAIMS_RULE.message} (claim {c.name!r} is named twice)")
        seen.add(c.name)
