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


def exactly_one(fields: tuple[str, ...], where: str) -> dict:
    """The CEL rule "set exactly one of these (wire-named) fields" on the type that holds them."""
    count = " + ".join(f"(has(self.{f}) ? 1 : 0)" for f in fields)
    names = ", ".join(fields[:-1]) + f" or {fields[-1]}"
    return cel(f"{count} == 1", f"'{where}: set exactly one of {names}'")


def check_exactly_one(obj: ApiModel, fields: tuple[str, ...], where: str) -> None:
    """The same rule for the operator's own parse (python names in, wire names in the message)."""
    if sum(getattr(obj, f) is not None for f in fields) != 1:
        wire = [type(obj).model_fields[f].alias or f for f in fields]
        names = ", ".join(wire[:-1]) + f" or {wire[-1]}"
        given = [w for f, w in zip(fields, wire, strict=True) if getattr(obj, f) is not None]
        raise ValueError(f"{where}: set exactly one of {names} (given: {', '.join(given) or 'none'})")
