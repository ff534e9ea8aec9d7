"""What crosses a Ray call is typed: no actor method takes or answers a bare `dict` or `Any`.

A dict read by key on the far side (`answer["state"]`) fails in another process, later, as a
KeyError; a dataclass or an enum fails where it is written. The actors are found in the code
(every class handed to `ray.remote` or `shared_actor`), so a new one is checked without being
listed here.
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from pathlib import Path

import orchestrator

PACKAGE = Path(orchestrator.__file__).parent
# `ray.remote(Cls)`, `ray.remote(concurrency_groups={...})(Cls)`, `shared_actor(Cls, ...)`,
# `actor_class(Cls)`
STARTED = re.compile(
    r"(?:ray\.remote\((?:[^()]*\)\()?|shared_actor\(\s*|actor_class\()([A-Z]\w+)\b"
)


def actor_classes() -> dict[str, type]:
    names = {m for path in PACKAGE.rglob("*.py") for m in STARTED.findall(path.read_text())}
    found: dict[str, type] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if any(f"class {name}" in path.read_text() for name in names):
            for name, cls in vars(importlib.import_module(module)).items():
                if name in names and inspect.isclass(cls) and cls.__module__ == module:
                    found[name] = cls
    return found


def loose(annotation: object) -> bool:
    """Whether a type is, or holds, a bare dict or Any."""
    if annotation is typing.Any or annotation is dict or typing.get_origin(annotation) is dict:
        return True
    return any(loose(arg) for arg in typing.get_args(annotation))


def test_every_actor_is_found():
    expected = {"NodeAgent", "Rendezvous", "WeightCache", "QueueService", "CheckpointUploader",
                "WeightMirror", "TrainingCacheSeeder", "SecretStoreActor"}  # fmt: skip
    assert expected <= set(actor_classes())


def test_no_actor_method_takes_or_answers_a_dict_or_any():
    offenders = [
        f"{cls.__name__}.{name}: {arg}: {hint}"
        for cls in actor_classes().values()
        for name, method in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
        for arg, hint in typing.get_type_hints(method).items()
        if loose(hint)
    ]
    assert not offenders, "\n".join(offenders)
