"""Shared building blocks of the spec: the strict base model and reusable field checks."""

from __future__ import annotations

import enum
import posixpath
import re
from fractions import Fraction
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

E = TypeVar("E", bound=enum.Enum)


class StrictModel(BaseModel):
    """Like truss_train's `SafeModelNoExtra`: no coercion, no unknown keys, checked on set."""

    model_config = ConfigDict(strict=True, extra="forbid", validate_assignment=True)


class ConfigModel(StrictModel):
    """Like truss's `ConfigModel` (WeightsSource, AcceleratorSpec, Checkpoint, LoRADetails): an
    unknown key is kept, as Baseten keeps it, and `push` warns that nothing reads it; values are
    coerced as there (`count="8"` is 8)."""

    model_config = ConfigDict(strict=False, extra="allow", validate_assignment=True)


class FieldProblem(ValueError):
    """A validator's finding about a field below the one it validates: the error names that
    leaf. `at` continues the path from where the validator sits, e.g. `(1, "mount_location")`
    from a validator of `weights`, so the error reads `TrainingJob.weights[1].mount_location`."""

    def __init__(self, at: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.at = at


_SAFE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9 ._()+-]{0,126}[A-Za-z0-9_()+-])?$")


def check_safe_name(value: str) -> str:
    """Names become path segments (storage layout, Ray names): no '/', no leading '.'.

    Spaces are allowed inside ("Axolotl 20B 1 Node", as Baseten's cookbook names projects).
    """
    if not _SAFE_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a safe name: use 1-128 letters, digits, spaces, '.', '_', '-', "
            "'+' or parentheses, starting with a letter or digit and not ending with '.' or a space"
        )
    return value


SafeName = Annotated[str, AfterValidator(check_safe_name)]

MAX_NAME_LENGTH = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def check_display_name(value: str) -> str:
    """A project or job name as a person writes it ("demo/qwen3-0.6b", "Axolotl 20B 1 Node",
    "검색 모델"), as Baseten takes it. It is never a path, an actor name or a shell word (those
    use ids), so only what cannot be shown on one line is refused."""
    if not value.strip():
        raise ValueError("must not be empty")
    if _CONTROL.search(value):
        raise ValueError(f"{value!r} contains a control character (a newline, a tab, ...)")
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"is {len(value)} characters long; at most {MAX_NAME_LENGTH}")
    return value


DisplayName = Annotated[str, AfterValidator(check_display_name)]


def lenient_enum(enum_cls: type[E]) -> Any:
    """An enum field that also takes the member's value or name as a string (any case).

    truss_train is strict and rejects `availability_model="spot"`; accepting it loses nothing and
    keeps configs written for Baseten (which pass members) working unchanged.
    """

    def coerce(value: Any) -> Any:
        if isinstance(value, str) and not isinstance(value, enum_cls):
            for member in enum_cls:
                if value.lower() in (str(member.value).lower(), member.name.lower()):
                    return member
            allowed = ", ".join(repr(m.value) for m in enum_cls)
            raise ValueError(f"{value!r} is not one of {allowed}")
        return value

    return Annotated[enum_cls, BeforeValidator(coerce)]


_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|Ki|Mi?|Gi?|Ti?|Pi?|Ei?)?\s*$")
_MEMORY_UNITS = {
    None: 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def parse_memory(value: str) -> int:
    """Kubernetes-style quantity ("2Gi", "512M", "1.5G") to bytes."""
    match = _MEMORY.fullmatch(value)
    if not match:
        raise ValueError(
            f"{value!r} is not a memory size: write a number with an optional unit, one of "
            "k, M, G, T, P, E, Ki, Mi, Gi, Ti, Pi, Ei (for example '2Gi' or '512Mi')"
        )
    number, unit = match.groups()
    return int(Fraction(number) * _MEMORY_UNITS[unit])  # exact: floats garble large sizes


def check_memory(value: str) -> str:
    parse_memory(value)
    return value


MemoryQuantity = Annotated[str, AfterValidator(check_memory)]


def check_absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} must be an absolute path (starting with /)")
    return value


AbsolutePath = Annotated[str, AfterValidator(check_absolute)]

# A job's directories on a node are created, written into, emptied or linked by orchestrator.
# In the node's system trees, or as a top-level directory everything on the node shares, that
# would harm the node.
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
                "/run", "/sbin", "/sys", "/usr")  # fmt: skip
SHARED_DIRECTORIES = ("/", "/home", "/media", "/mnt", "/opt", "/root", "/srv", "/tmp", "/var",
                      "/var/lib", "/var/tmp")  # fmt: skip


def check_job_directory(value: str) -> str:
    """An absolute path a job may own on a node: not a system directory, not `/tmp` itself."""
    check_absolute(value)
    path = "/" + posixpath.normpath(value).lstrip("/")
    if path in SHARED_DIRECTORIES:
        where = "the root directory" if path == "/" else f"{path} itself"
        raise ValueError(
            f"{value!r} is {where}, which everything on the node shares: use a directory of "
            "the job's own below it, such as /tmp/checkpoints or /mnt/data"
        )
    tree = next((t for t in SYSTEM_TREES if path == t or path.startswith(f"{t}/")), None)
    if tree is not None:
        raise ValueError(
            f"{value!r} is in {tree}, a system directory of the node: use a directory of the "
            "job's own, such as /tmp/checkpoints or /mnt/data"
        )
    return value


JobDirectory = Annotated[str, AfterValidator(check_job_directory)]
