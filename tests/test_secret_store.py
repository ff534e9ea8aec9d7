"""The file secret store and the environment source, without Ray."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from orchestrator.errors import OrchestratorError
from orchestrator.node.secrets import SecretNotFound, resolve_secret
from orchestrator.storage.secret_store import (
    EnvSecrets,
    FileSecretStore,
    SecretStoreError,
    default_secrets_dir,
    secret_env_name,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def store(tmp_path: Path) -> FileSecretStore:
    return FileSecretStore(tmp_path / "secrets")


def test_directories_are_0700_and_files_0600_whatever_the_umask(store):
    old = os.umask(0o000)  # the most permissive umask: modes must not depend on it
    try:
        store.set("hf_token", "hf_abc123", team="alpha")
        store.set("hf_token", "hf_def456")
    finally:
        os.umask(old)
    d = store.directory
    for directory in (d, d / "default", d / "teams", d / "teams" / "alpha"):
        assert mode(directory) == 0o700, directory
    for file in (d / "default" / "hf_token", d / "teams" / "alpha" / "hf_token"):
        assert mode(file) == 0o600, file
    assert sorted(p.name for p in (d / "default").iterdir()) == ["hf_token"]  # no temp files left


def test_set_get_overwrite_delete(store):
    assert store.get("api_key") is None
    store.set("api_key", "first value\nwith two lines")
    assert store.get("api_key") == "first value\nwith two lines"
    store.set("api_key", "second")
    assert store.get("api_key") == "second"
    assert store.delete("api_key") is True
    assert store.get("api_key") is None
    assert store.delete("api_key") is False


def test_names_list_names_scope_and_time_never_values(store):
    store.set("b_token", "value-b")
    store.set("a_token", "value-a")
    store.set("c_token", "value-c", team="alpha")
    found = store.names()
    assert [(s.name, s.team, s.scope) for s in found] == [
        ("a_token", None, "cluster-wide"),
        ("b_token", None, "cluster-wide"),
    ]
    assert all(s.modified_at > 0 for s in found)
    assert [(s.name, s.scope) for s in store.names("alpha")] == [("c_token", "team alpha")]
    assert "value" not in repr(found)
    assert store.teams() == ["alpha"]


def test_a_team_reads_its_own_then_the_cluster_wide_one_never_another_teams(store):
    store.set("shared", "cluster-value")
    store.set("shared", "alpha-value", team="alpha")
    store.set("alpha_only", "alpha-secret", team="alpha")
    assert store.get("shared", team="alpha") == "alpha-value"
    assert store.get("shared", team="beta") == "cluster-value"
    assert store.get("shared") == "cluster-value"
    assert store.get("alpha_only", team="beta") is None
    assert store.get("alpha_only") is None  # a job without a team reads only cluster-wide ones
    assert [(s.name, s.scope) for s in store.visible("alpha")] == [
        ("alpha_only", "team alpha"),
        ("shared", "team alpha"),
    ]
    assert [(s.name, s.scope) for s in store.visible("beta")] == [("shared", "cluster-wide")]
    # Deleting the team's copy exposes the cluster-wide one again; delete is per scope.
    assert store.delete("shared", team="alpha")
    assert store.get("shared", team="alpha") == "cluster-value"
    assert not store.delete("alpha_only")


@pytest.mark.parametrize("name", ["", "a/b", "../x", ".hidden", "x" * 129, "with space"])
def test_secret_names_are_checked_like_the_spec(store, name):
    for call in (
        lambda: store.set(name, "v"),
        lambda: store.get(name),
        lambda: store.delete(name),
    ):
        with pytest.raises(SecretStoreError, match="is not a secret name"):
            call()
    assert not store.directory.exists()


@pytest.mark.parametrize("team", ["", "../x", "a/b", ".team", "trailing."])
def test_team_names_are_checked_like_the_spec(store, team):
    with pytest.raises(SecretStoreError, match="team name"):
        store.set("token", "v", team=team)
    with pytest.raises(SecretStoreError, match="team name"):
        store.names(team)
    assert not store.directory.exists()


def test_an_empty_value_is_refused(store):
    with pytest.raises(SecretStoreError, match="empty"):
        store.set("token", "")


def test_a_store_open_to_other_users_is_refused_not_read(store):
    store.set("token", "v-123456")
    os.chmod(store.directory, 0o755)
    for call in (
        lambda: store.get("token"),
        lambda: store.names(),
        lambda: store.set("token", "x"),
        lambda: store.delete("token"),
    ):
        with pytest.raises(SecretStoreError, match=r"chmod 700 .*secrets"):
            call()
    os.chmod(store.directory, 0o700)
    os.chmod(store.directory / "default" / "token", 0o644)
    with pytest.raises(SecretStoreError, match="chmod 600") as e:
        store.get("token")
    assert "v-123456" not in str(e.value)
    assert isinstance(e.value, OrchestratorError)


def test_default_directory_and_never_inside_the_storage_root(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ORCHESTRATOR_SECRETS_DIR", raising=False)
    monkeypatch.delenv("ORCHESTRATOR_STORAGE_ROOT", raising=False)
    assert default_secrets_dir() == tmp_path / "home" / "secrets"
    monkeypatch.setenv("ORCHESTRATOR_SECRETS_DIR", str(tmp_path / "elsewhere"))
    assert FileSecretStore().directory == tmp_path / "elsewhere"
    monkeypatch.setenv("ORCHESTRATOR_SECRETS_DIR", str(tmp_path / "home" / "storage" / "s"))
    with pytest.raises(SecretStoreError, match="inside the storage root"):
        default_secrets_dir()


def test_the_environment_source():
    env = EnvSecrets({"ORCHESTRATOR_SECRET_HF_ACCESS_TOKEN": "hf_xyz"})
    assert secret_env_name("hf-access.token") == "ORCHESTRATOR_SECRET_HF_ACCESS_TOKEN"
    assert env.get("hf_access_token") == env.get("hf_access_token", team="any") == "hf_xyz"
    assert env.get("missing") is None
    assert env.describe("missing") == "as ORCHESTRATOR_SECRET_MISSING on this node"


def test_resolve_secret_falls_back_to_the_environment_without_a_store(monkeypatch):
    """Without Ray (or with no store actor running) only the node's environment is asked."""
    monkeypatch.setenv("ORCHESTRATOR_SECRET_CI_TOKEN", "ci-0a1b2c3d")
    assert resolve_secret("ci_token") == resolve_secret("ci_token", team="alpha") == "ci-0a1b2c3d"
    with pytest.raises(SecretNotFound) as e:
        resolve_secret("nowhere_token", team="alpha")
    assert str(e.value) == (
        "secret 'nowhere_token' is not set as ORCHESTRATOR_SECRET_NOWHERE_TOKEN on this node "
        "(and no secret store is running on this cluster to ask)"
    )
