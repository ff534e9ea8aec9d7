"""A client refused for its token gets one line that says which case it is and where it
looked, whichever of Ray's paths refused it (the Job API, Ray's client, a gRPC server)."""

from __future__ import annotations

import pytest

from orchestrator.cluster.auth import refusal

URL = "http://head:8265"
# Ray's own words, as its Job API client, its token loader and ray.init raise them.
MISSING = "Authentication required: Unauthorized: Missing authentication token\n\nEnsure ..."
WRONG = "Authentication failed: Forbidden: Invalid authentication token\n\nEnsure ..."
NONE_HERE = "Token authentication is enabled but Ray couldn't find an authentication token. ..."
GRPC = "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token is "


@pytest.fixture
def laptop(tmp_path, monkeypatch):
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def wrapped(text: str) -> Exception:
    """As ray.init raises it: a ConnectionError whose cause holds Ray's words."""
    try:
        try:
            raise RuntimeError(f"Traceback (most recent call last):\n  ...\n{text}missing")
        except RuntimeError as e:
            raise ConnectionError("Failed to connect to Ray cluster at head:6379") from e
    except ConnectionError as e:
        return e


def test_each_refusal_is_one_line_naming_the_case_and_where_the_client_looked(laptop, monkeypatch):
    none = f"the Ray cluster at {URL} demands a token and this client has none"
    assert refusal(RuntimeError(MISSING), URL) == (
        f"{none} (~/.ray/auth_token is missing or empty); put the cluster's token there"
    )
    assert refusal(RuntimeError(NONE_HERE), URL).startswith(none)
    assert refusal(wrapped(GRPC), URL).startswith(none)  # nothing sent: none, not a wrong one
    (laptop / ".ray").mkdir()
    (laptop / ".ray" / "auth_token").write_text("not-the-clusters")
    wrong = (f"the Ray cluster at {URL} refused this client's token (~/.ray/auth_token): it is "
             "not the cluster's; put the cluster's token there")  # fmt: skip
    assert refusal(RuntimeError(WRONG), URL) == wrong
    assert refusal(wrapped(GRPC), URL) == wrong
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x")
    assert "(RAY_AUTH_TOKEN)" in refusal(RuntimeError(WRONG), URL)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert refusal(RuntimeError(MISSING)) == (
        "the Ray cluster demands a token: export RAY_AUTH_MODE=token and put the cluster's "
        "token in ~/.ray/auth_token (or name its file in RAY_AUTH_TOKEN_PATH)"
    )


def test_any_other_error_is_not_a_refusal(laptop):
    assert refusal(ConnectionError("Failed to connect to Ray cluster at head:6379"), URL) is None
    assert refusal(wrapped("connection refused\n"), URL) is None
