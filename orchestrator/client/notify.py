"""Webhook notifications from a client: subscriptions written into the storage root
(`storage/notify_store.py`), which the cluster's queue service reads and delivers to
(`scheduler/webhooks.py`). Each change is audited; a subscription names its signing secret, whose
value stays in the secret store.
"""

from __future__ import annotations

import getpass
import os
import secrets
import socket
import time
from urllib.parse import urlsplit

from orchestrator.client.audit import audited
from orchestrator.client.connection import storage
from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.spec.base import check_safe_name
from orchestrator.spec.secrets import check_secret_name
from orchestrator.storage.notify_store import ALL_KINDS, NotifyStore, Subscription

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def add_webhook(
    url: str,
    *,
    secret: str,
    team: str | None = None,
    events: list[str] | None = None,
    storage_root: str | None = None,
) -> Subscription:
    """Subscribe `url` to the events of `team`'s jobs (None: every job): `events` among failed,
    completed, preempted, stuck (None: all four), signed with the secret named `secret`."""
    _check_url(url)
    kinds = _check_events(events)
    try:
        check_secret_name(secret)
        team = check_safe_name(team) if team is not None else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    root = storage(storage_root)
    store = NotifyStore(root)
    detail = f"{','.join(kinds)} to {_where(url)}"  # a URL's path may hold a token: never logged
    with audited(root, "notify add", team=team, detail=detail) as audit:
        while True:
            sub = Subscription(id=_new_id(), url=url, team=team, events=kinds, secret=secret,
                               created_at=time.time(), created_by=_who())  # fmt: skip
            if store.add_subscription(sub):
                audit["target"] = sub.id
                return sub


def webhooks(*, team: str | None = None, storage_root: str | None = None) -> list[Subscription]:
    """The subscriptions, oldest first; `team`: those that see its jobs (its own, and those for
    every team)."""
    found = NotifyStore(storage(storage_root)).subscriptions()
    return [s for s in found if team is None or s.team in (None, team)]


def remove_webhook(subscription_id: str, *, storage_root: str | None = None) -> Subscription:
    """Remove a subscription: nothing more is delivered to it, not even what it was owed."""
    root = storage(storage_root)
    store = NotifyStore(root)
    known = _is_id(subscription_id)  # anything else names nothing stored: never a path
    with audited(root, "notify remove", target=subscription_id if known else None) as audit:
        sub = store.subscription(subscription_id) if known else None
        if sub is None:
            raise OrchestratorError(f"no webhook {subscription_id!r} in {root.url}: "
                                    "`orchestrator notify list` shows them")  # fmt: skip
        audit["team"] = sub.team
        store.remove_subscription(sub.id)
    return sub


def _check_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--url {url!r}: a webhook is an http:// or https:// URL with a host, "
                          "for example https://hooks.example.com/orchestrator")  # fmt: skip


def _check_events(events: list[str] | None) -> list[str]:
    if not events:
        return list(ALL_KINDS)
    kinds = [k.strip().lower() for e in events for k in e.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown or not kinds:
        raise ConfigError(f"--events {','.join(events)!r}: use some of {','.join(ALL_KINDS)}")
    return [k for k in ALL_KINDS if k in kinds]


def _where(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"


def _is_id(value: str) -> bool:
    return len(value) == 10 and value[0] == "w" and all(c in _ID_ALPHABET for c in value[1:])


def _new_id() -> str:
    """'w' + 9 base-36 characters, as job ids."""
    return "w" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"
