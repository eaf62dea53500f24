"""Record: the base of every typed record, so each one validates the same way and writes back what it read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError
from pydantic_core import PydanticCustomError

from poolbench.errors import PoolBenchError


def _number(value: object) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError("number_type", "Input should be a valid number")
    return float(value) if isinstance(value, float) else int(value)


# A JSON number kept as given: an int stays an int, so a record's JSON is byte for byte the JSON it came from
# (numpy floats become plain floats; strings and booleans are refused).
Number = Annotated[float | int, PlainValidator(_number)]

R = TypeVar("R", bound="Record")


class RecordError(PoolBenchError):
    """A dict that is not a valid record: one line naming the record type, the field and the fault."""


def _one_line(name: str, exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    field = ".".join(str(p) for p in first["loc"]) or "(record)"
    got = "" if first["type"] == "missing" else f" (got {first['input']!r:.60})"
    more = f"; and {len(errors) - 1} more" if len(errors) > 1 else ""
    return f"{name}: field '{field}': {first['msg']}{got}{more}"


class Record(BaseModel):
    """Frozen and strict (no str -> number coercion); keys absent when read stay absent when written."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """The record a stored or written dict describes; a malformed one fails in one line."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise RecordError(_one_line(cls.__name__, exc)) from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict: declared key order, only the keys the record was given."""
        return self.model_dump(exclude_unset=True)
