"""The pydantic base of every CRD type: camelCase on the wire, unknown fields rejected, frozen."""

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """`extra="forbid"` so a typo in a manifest is an error naming the field, never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    def wire(self) -> dict:
        """The camelCase dict as stored in Kubernetes, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def cel(rule: str, message_expression: str, reason: str | None = None) -> dict:
    """One `x-kubernetes-validations` entry (CEL), kept next to the type it guards."""
    entry = {"rule": rule, "messageExpression": message_expression}
    if reason:
        entry["reason"] = reason
    return entry
