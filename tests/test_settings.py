"""orchestrator's environment variables: one registry, one error for a bad value, documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator import settings
from orchestrator.client.submit import scheduling_timeout
from orchestrator.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
# What a job's commands are given, not settings: where each is defined.
JOB_GIVEN = {
    "ORCHESTRATOR_PROGRESS_FILE": "node/progress_beat.py",
    "ORCHESTRATOR_RAY_ADDRESS": "agents/rank_program.py",
    "ORCHESTRATOR_TRAIN_PG": "agents/ray_train_seams.py",
    "ORCHESTRATOR_TRAIN_WORKERS": "agents/ray_train_seams.py",
    "ORCHESTRATOR_TRAIN_REPORTS_ROOT": "agents/ray_train_seams.py",
    "ORCHESTRATOR_TRAIN_CHECKPOINT_PATH": "agents/ray_train_seams.py",
}


def test_configuration_md_lists_exactly_the_settings():
    text = DOCS.read_text()
    section = text[text.index("## Environment variables") : text.index("## Differences from")]
    # Full names only: "ORCHESTRATOR_CHECKPOINT_*" and the like name a group, not a variable.
    documented = set(re.findall(r"\bORCHESTRATOR_[A-Z0-9_]*[A-Z0-9]\b(?!_\*)", section))
    documented -= JOB_GIVEN.keys()
    assert documented == {s.name for s in settings.all_settings()}


def test_every_variable_is_read_through_the_registry():
    """No module reads an ORCHESTRATOR_* variable of its own: a new one lands in settings.py."""
    package = Path(settings.__file__).parent
    # A full name (a prefix such as ORCHESTRATOR_SECRET_ ends in "_").
    defined = re.compile(r"=\s*\"(ORCHESTRATOR_[A-Z0-9_]*[A-Z0-9])\"$", re.M)
    direct = [
        (str(path.relative_to(package)), match.group(1))
        for path in package.rglob("*.py")
        if path.name != "settings.py"
        for match in defined.finditer(path.read_text())
    ]
    assert sorted(direct) == sorted((path, name) for name, path in JOB_GIVEN.items())


@pytest.mark.parametrize("raw", ["soon", "0", "-5"])
def test_a_bad_value_is_one_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("ORCHESTRATOR_SCHEDULING_TIMEOUT_S", raw)
    with pytest.raises(ConfigError) as info:
        scheduling_timeout()
    assert str(info.value) == (
        f"ORCHESTRATOR_SCHEDULING_TIMEOUT_S must be a number above 0 (got {raw!r})"
    )
    monkeypatch.setenv("ORCHESTRATOR_SCHEDULING_TIMEOUT_S", " 30 ")
    assert scheduling_timeout() == 30.0


@pytest.mark.parametrize(("raw", "mode"), [("", "never"), ("Resumable", "resumable"),
                                          (" always ", "always")])  # fmt: skip
def test_preemption_within_a_team_is_never_unless_set(monkeypatch, raw, mode):
    monkeypatch.setenv("ORCHESTRATOR_QUEUE_PREEMPT_WITHIN_TEAM", raw)
    assert settings.QUEUE_PREEMPT_WITHIN_TEAM.get() == mode
    monkeypatch.setenv("ORCHESTRATOR_QUEUE_PREEMPT_WITHIN_TEAM", "yes")
    with pytest.raises(ConfigError, match="must be never, resumable or always"):
        settings.QUEUE_PREEMPT_WITHIN_TEAM.get()
