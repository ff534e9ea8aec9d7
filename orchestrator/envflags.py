"""Reading orchestrator's on/off environment variables one way everywhere."""

from __future__ import annotations

import os

_OFF = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """True unless the variable is unset, empty, 0, false, no or off (any case)."""
    return os.environ.get(name, "").strip().lower() not in _OFF
