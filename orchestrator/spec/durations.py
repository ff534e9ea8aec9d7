"""Durations as a person writes them: "2h", "90m", "45s", "1h30m", "1.5h", or a number of seconds.

`parse_duration` gives the seconds; `format_duration` writes seconds back as "2h 0m" for
messages. The spec keeps what the user wrote (`Duration`), so that a message can quote it.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Union

from pydantic import BeforeValidator, StrictFloat, StrictInt, StrictStr

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*([dhms])", re.IGNORECASE)
_WHOLE = re.compile(r"^\s*(?:(?:\d+(?:\.\d+)?|\.\d+)\s*[dhms]\s*)+$", re.IGNORECASE)
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*$")
_HOW = "write a number with a unit, d, h, m or s (for example '2h', '90m', '1h30m', '45s')"


def parse_duration(value: str | float | int) -> float:
    """Seconds, above 0; ValueError with a one-line reason otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError("must be a duration such as '2h' or '90m', or a number of seconds")
    if isinstance(value, str):
        if number := _NUMBER.fullmatch(value):  # a bare number is seconds, as on the CLI
            seconds = float(number.group(1))
        elif _WHOLE.fullmatch(value):
            seconds = sum(float(n) * _UNITS[u.lower()] for n, u in _PART.findall(value))
        else:
            raise ValueError(f"{value!r} is not a duration: {_HOW}")
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError("must be a time above 0, such as '2h' or '90m'")
    return seconds


def format_duration(seconds: float) -> str:
    """`2h 0m`, `1h 30m`, `6m 5s`, `45s`, `3.2s`: for messages."""
    if seconds < 60:
        return f"{seconds:.1f}s".replace(".0s", "s")
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s"


def spelled(value: str | float | int) -> str:
    """A duration as the user wrote it, for messages: "2h", or "7200s" for a number."""
    if isinstance(value, str):
        return f"{value.strip()}s" if _NUMBER.fullmatch(value) else value.strip()
    return f"{value:g}s"


def _check(value: Any) -> Any:
    parse_duration(value)
    return value


# What the user wrote, checked; the seconds are `parse_duration(value)`.
Duration = Annotated[Union[StrictStr, StrictFloat, StrictInt], BeforeValidator(_check)]  # noqa: UP007
