"""Turns pydantic's validation errors into one line per problem: field path, then the reason."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from orchestrator.spec.base import FieldProblem

_PREFIXES = ("Value error, ", "Assertion failed, ")


def describe_validation_error(
    error: ValidationError, model: type[BaseModel] | None = None, prefix: str | None = None
) -> list[str]:
    """One line per problem, e.g. `job.compute.node_count: must be >= 1 (got 0)`.

    `model` is the class that was validated (so union members and internals drop out of the
    path); `prefix` starts every path (defaults to the model's name).
    """
    lines: dict[str, list[str]] = {}
    for item in error.errors(include_url=False):
        loc = item["loc"]
        if isinstance(found := (item.get("ctx") or {}).get("error"), FieldProblem):
            loc = (*loc, *found.at)  # the leaf the validator named
        path, owner = _clean_path(model, loc) if model else (_raw_path(loc), None)
        head = prefix if prefix is not None else (model.__name__ if model else error.title)
        if item["type"] == "extra_forbidden":
            unknown = path.rsplit(".", 1)[-1]
            path = path.rsplit(".", 1)[0] if "." in path else ""
            allowed = ", ".join(owner.model_fields) if owner else ""
            reason = f"unknown field {unknown!r}" + (
                f"; allowed fields: {allowed}" if allowed else ""
            )
        else:
            reason = _reason(item)
        full = ".".join(p for p in (head, path) if p).replace(".[", "[") or "config"
        lines.setdefault(full, [])
        if reason not in lines[full]:
            lines[full].append(reason)
    return [f"{path}: {' or '.join(reasons)}" for path, reasons in lines.items()]


def _reason(item: Mapping[str, Any]) -> str:
    message = str(item["msg"])
    for p in _PREFIXES:
        if message.startswith(p):
            message = message[len(p) :]
    if item["type"] == "missing":
        return "is required"
    value = item.get("input")
    if isinstance(value, (str, int, float, bool)) or value is None:
        shown = repr(value)
        if len(shown) <= 60 and shown not in message:
            message += f" (got {shown})"
    return message


def _raw_path(loc: Sequence[Any]) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc)


def _clean_path(model: type[BaseModel], loc: Sequence[Any]) -> tuple[str, type[BaseModel] | None]:
    """Walk `loc` through the model's annotations, keeping only segments a user wrote."""
    parts: list[str] = []
    current: Any = model
    owner: type[BaseModel] | None = model
    for segment in loc:
        models = _models_in(current)
        field_owner = next((m for m in models if segment in m.model_fields), None)
        if isinstance(segment, str) and field_owner is not None:
            parts.append(segment)
            owner = field_owner
            current = field_owner.model_fields[segment].annotation
        elif isinstance(segment, int) and (item := _container_item(current, list)) is not None:
            parts.append(f"[{segment}]")
            current = item
        elif isinstance(segment, str) and (item := _container_item(current, dict)) is not None:
            parts.append(segment)
            current = item
        elif isinstance(segment, str) and models and segment not in _member_names(current):
            parts.append(segment)  # an unknown key under a model: keep it for the message
        # otherwise: a union member tag or pydantic internal name, invisible to users
        if models and field_owner is None:
            owner = models[0]
    return ".".join(parts), owner


def _flatten(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _flatten(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _flatten(arg)]
    return [annotation]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    return [t for t in _flatten(annotation) if isinstance(t, type) and issubclass(t, BaseModel)]


def _member_names(annotation: Any) -> set[str]:
    """Names pydantic uses for union members in error locations."""
    names = set()
    for t in _flatten(annotation):
        names.add(getattr(t, "__name__", str(t)))
        if isinstance(t, type) and issubclass(t, BaseModel) and "typ" in t.model_fields:
            names.add(str(t.model_fields["typ"].default))
    return names


def _container_item(annotation: Any, kind: type) -> Any | None:
    for t in _flatten(annotation):
        if typing.get_origin(t) is kind:
            args = typing.get_args(t)
            return args[-1] if args else Any
    return None
