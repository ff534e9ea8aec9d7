"""`orchestrator secrets set|list|delete` as a user runs them; no Ray, a store in tmp_path."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.storage.secret_store import FileSecretStore

VALUE = "sk-live-5f0e7a3c91d2"
TEAM_VALUE = "sk-team-84b1c6d07e3a"


@pytest.fixture
def secrets_dir(tmp_path: Path) -> Path:
    return tmp_path / "secrets"


@pytest.fixture
def cli(secrets_dir: Path, tmp_path: Path):
    outputs: list[str] = []

    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "COLUMNS": "200", "ORCHESTRATOR_SECRETS_DIR": str(secrets_dir),
               "ORCHESTRATOR_HOME": str(tmp_path / "home")}  # fmt: skip
        env.pop("RAY_ADDRESS", None)
        result = subprocess.run(
            [sys.executable, "-m", "orchestrator", "secrets", *args],
            input=stdin, capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        outputs.extend([result.stdout, result.stderr])
        return result

    yield run
    for out in outputs:  # whatever ran, no value was ever printed
        assert VALUE not in out and TEAM_VALUE not in out


def test_set_from_stdin_list_and_delete(cli, secrets_dir):
    r = cli("set", "api_key", stdin=VALUE + "\n")
    assert r.returncode == 0, r.stderr
    assert "secret api_key set (cluster-wide)" in r.stdout
    r = cli("set", "api_key", "--team", "alpha", stdin=TEAM_VALUE)
    assert r.returncode == 0, r.stderr
    assert "secret api_key set (team alpha)" in r.stdout
    store = FileSecretStore(secrets_dir)
    assert store.get("api_key") == VALUE  # one trailing newline dropped
    assert store.get("api_key", team="alpha") == TEAM_VALUE
    assert stat.S_IMODE(os.stat(secrets_dir / "default" / "api_key").st_mode) == 0o600

    r = cli("list")
    assert r.returncode == 0, r.stderr
    assert "api_key" in r.stdout and "cluster-wide" in r.stdout

    r = cli("list", "--all-teams", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(row["name"], row["team"], row["scope"]) for row in rows] == [
        ("api_key", None, "cluster-wide"),
        ("api_key", "alpha", "team alpha"),
    ]
    assert all(set(row) == {"name", "team", "scope", "modified_at"} for row in rows)

    r = cli("list", "--team", "alpha", "-o", "json")
    assert [row["scope"] for row in json.loads(r.stdout)] == ["team alpha"]

    r = cli("delete", "api_key", "--team", "alpha")
    assert r.returncode == 0, r.stderr
    assert "secret api_key deleted (team alpha)" in r.stdout
    assert "now read the cluster-wide api_key" in r.stdout
    assert store.get("api_key", team="alpha") == VALUE

    r = cli("delete", "api_key", "--team", "alpha")
    assert r.returncode == 1
    assert "no secret api_key (team alpha)" in r.stderr
    assert "orchestrator secrets list --team alpha" in r.stderr


def test_the_value_is_never_taken_from_an_argument(cli, secrets_dir):
    r = cli("set", "api_key", VALUE)
    assert r.returncode == 1
    assert "never as an argument" in r.stderr and "rotate it" in r.stderr
    assert not secrets_dir.exists()


def test_an_empty_value_and_bad_names_are_refused(cli, secrets_dir):
    r = cli("set", "api_key", stdin="\n")
    assert r.returncode == 1 and "empty" in r.stderr
    r = cli("set", "../api_key", stdin=VALUE)
    assert r.returncode == 1 and "is not a secret name" in r.stderr
    r = cli("set", "api_key", "--team", "../other", stdin=VALUE)
    assert r.returncode == 1 and "team name" in r.stderr
    assert not secrets_dir.exists()


def test_list_of_an_empty_store(cli):
    r = cli("list")
    assert r.returncode == 0, r.stderr
    assert "no secrets (cluster-wide)" in r.stdout
    r = cli("list", "-o", "json")
    assert json.loads(r.stdout) == []
