"""Accelerator types and the per-node accelerator request (truss's `AcceleratorSpec`)."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import Field, model_validator

from orchestrator.spec.base import ConfigModel, FieldProblem, lenient_enum


class Accelerator(str, enum.Enum):
    """GPU types, as Baseten names them. On Ray each is also a resource constraint."""

    T4 = "T4"
    L4 = "L4"
    A10G = "A10G"
    V100 = "V100"
    A100 = "A100"
    A100_40GB = "A100_40GB"
    H100 = "H100"
    H100_40GB = "H100_40GB"
    H200 = "H200"
    B200 = "B200"
    L40S = "L40S"
    RTX_PRO_6000 = "RTX_PRO_6000"
    B300 = "B300"
    GB300 = "GB300"


class AcceleratorSpec(ConfigModel):
    """Accelerators per node. Also written as a string: `"H100"` or `"H100:8"`."""

    accelerator: lenient_enum(Accelerator) | None = None  # type: ignore[valid-type]
    count: int = Field(default=1, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        name, _, count = value.partition(":")
        if count and not (count.isdigit() and int(count) > 0):
            raise ValueError(
                f"{value!r} is not an accelerator spec: write TYPE or TYPE:COUNT with COUNT > 0, "
                "for example 'H100' or 'H100:8'"
            )
        return {"accelerator": name.strip(), "count": int(count) if count else 1}

    @model_validator(mode="after")
    def _count_matches_type(self) -> AcceleratorSpec:
        if self.accelerator is not None and self.count < 1:
            raise FieldProblem(
                ("count",), f"must be at least 1 when accelerator is {self.accelerator.value}"
            )
        return self

    def __str__(self) -> str:
        if self.accelerator is None:
            return "none"
        return f"{self.accelerator.value}:{self.count}"
