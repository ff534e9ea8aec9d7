"""Webhook notifications without Ray: the events a job's status says happened (events_of), the
outbox (an event queued twice is queued once), subscriptions and their CLI, signatures, and the
deliverer driven directly against a receiver on 127.0.0.1 (order, once, 4xx given up, a missing
secret, the lease). The long outage and restarts: tests/test_notify_delivery.py."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time

import pytest
from conftest import eventually, free_port
from notify_jobs import SECRET, JobScript, Receiver
from typer.testing import CliRunner

from orchestrator.cli.cmd_notify import notify_app
from orchestrator.client.notify import add_webhook, remove_webhook, webhooks
from orchestrator.errors import ConfigError, OrchestratorError, SecretNotFound
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.job_events import events_of
from orchestrator.scheduler.webhooks import Answer, Backoff, WebhookDeliverer, sign
from orchestrator.storage import audit
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.notify_store import NotifyEvent, NotifyStore, Subscription
from orchestrator.storage.root import StorageRoot

FAST = Backoff(first_s=0.05, cap_s=0.2)


def ids(script: JobScript) -> list[str]:
    return [e.id for e in events_of(script.record, script.status)]


# --- events_of ---------------------------------------------------------------------------------


def test_each_attempt_and_the_end_make_their_events_in_order_and_keep_their_places():
    job = JobScript(None, "j1", team="red", ray_address="http://127.0.0.1:8265")
    seen = [ids(job.run())]
    job.end_attempt("preempted_by_job", "gave way to j9", "gave way: back in the queue")
    seen.append(ids(job))  # still RUNNING: what follows is not known yet
    job.to(JobState.PENDING, "waiting in the queue")
    seen.append(ids(job))
    job.run().end_attempt("stuck", "rank 1 silent for 600 s")
    job.to(JobState.PENDING)
    job.run()
    seen.append(ids(job))
    job.end_attempt("command_failed", "exit 1", "ended: no retries left").fail("rank 0 exit 1")
    seen.append(ids(job))
    assert seen == [
        [], [], ["j1:0:preempted"], ["j1:0:preempted", "j1:1:stuck"],
        ["j1:0:preempted", "j1:1:stuck", "j1:2:failed"],
    ]  # fmt: skip
    events = events_of(job.record, job.status)
    assert [(e.kind, e.cause, e.final) for e in events] == [
        ("preempted", "preempted_by_job", False), ("stuck", "stuck", False),
        ("failed", "command_failed", True),
    ]  # fmt: skip
    assert events[1].reason == "rank 1 silent for 600 s"
    assert events[2].reason == "rank 0 exit 1" and events[2].state == "FAILED"
    assert events[0].team == "red" and events[0].job_name == "name-j1"
    assert events[0].links == {"dashboard": "http://127.0.0.1:8265/#/jobs/j1"}
    assert [e.at for e in events] == sorted(e.at for e in events)


def test_the_preempted_end_is_its_last_attempts_event_marked_final():
    job = JobScript(None, "j2").run()
    job.end_attempt("preempted", "node drained", "ended: preempted 21 times")
    assert ids(job) == []
    job.fail("preempted more often than allowed", JobState.PREEMPTED)
    (event,) = events_of(job.record, job.status)
    assert (event.id, event.state, event.final, event.cause) == (
        "j2:0:preempted", "PREEMPTED", True, "preempted")  # fmt: skip


def test_completed_deploy_failed_and_stopped():
    done = JobScript(None, "j3").run().end_attempt(None, decision="completed")
    assert ids(done.to(JobState.COMPLETED)) == ["j3:0:completed"]
    never = JobScript(None, "j4").fail("cannot be placed", JobState.DEPLOY_FAILED)
    (event,) = events_of(never.record, never.status)
    assert (event.id, event.kind, event.attempt, event.reason, event.links) == (
        "j4:0:failed", "failed", 0, "cannot be placed", {})  # fmt: skip
    stopped = JobScript(None, "j5").run().end_attempt("stopped").to(JobState.STOPPED)
    assert ids(stopped) == []


# --- the store -----------------------------------------------------------------------------------


def _event(job_id: str, n: int, kind: str = "failed") -> NotifyEvent:
    return NotifyEvent(id=f"{job_id}:{n}:{kind}", kind=kind, job_id=job_id, project="demo",
                       state="FAILED", attempt=n, at=time.time())  # fmt: skip


def test_an_event_queued_twice_is_queued_once_also_by_writers_racing(root):
    store = NotifyStore(root)
    first = [_event("j1", 0, "preempted"), _event("j1", 1)]
    assert [e.seq for e in store.queue("j1", first)] == [0, 1]
    assert [e.id for e in store.queue("j1", [*first, _event("j1", 1)])] == [e.id for e in first]
    more = [*first, _event("j1", 2, "stuck"), _event("j1", 3)]
    threads = [threading.Thread(target=NotifyStore(root).queue, args=("j1", more, []))
               for _ in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = store.events("j1")
    assert [(e.seq, e.id) for e in stored] == list(enumerate(e.id for e in more))


def test_subscriptions_want_their_kinds_their_team_and_what_came_after_them():
    at = time.time()
    sub = Subscription(id="w1", url="http://x", team="red", events=["failed"], secret="s",
                       created_at=at, created_by="me")  # fmt: skip
    event = _event("j1", 0).model_copy(update={"team": "red", "at": at + 1})
    assert sub.wants(event)
    assert not sub.wants(event.model_copy(update={"team": "blue"}))
    assert not sub.wants(event.model_copy(update={"kind": "completed"}))
    assert not sub.wants(event.model_copy(update={"at": at - 1}))
    assert sub.model_copy(update={"team": None}).wants(event.model_copy(update={"team": None}))


def test_the_signature_is_the_hmac_of_the_exact_body():
    body = _event("j1", 0).body()
    digest = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    assert sign(body, SECRET) == f"sha256={digest}"
    assert json.loads(body)["sequence"] == 0 and "seq" not in json.loads(body)


# --- the client and the CLI --------------------------------------------------------------------


def test_add_list_remove_are_audited_and_never_hold_the_secrets_value(tmp_path):
    url = str(tmp_path / "storage")
    sub = add_webhook("https://hooks.example.com/T0/B1/tok3n", secret="hook_key", team="red",
                      events=["failed,stuck"], storage_root=url)  # fmt: skip
    assert (sub.events, sub.team, sub.secret) == (["failed", "stuck"], "red", "hook_key")
    assert [s.id for s in webhooks(storage_root=url)] == [sub.id]
    assert webhooks(team="blue", storage_root=url) == []
    with pytest.raises(ConfigError, match="use some of failed,completed,preempted,stuck"):
        add_webhook("https://x.example", secret="k", events=["done"], storage_root=url)
    with pytest.raises(ConfigError, match="http:// or https://"):
        add_webhook("ftp://x.example", secret="k", storage_root=url)
    with pytest.raises(ConfigError, match="not a secret name"):
        add_webhook("https://x.example", secret="../k", storage_root=url)
    with pytest.raises(OrchestratorError, match="notify list"):
        remove_webhook("w000000000", storage_root=url)
    assert remove_webhook(sub.id, storage_root=url).id == sub.id
    assert webhooks(storage_root=url) == []
    trail = audit.read(StorageRoot(url))
    assert [(e.verb, e.target, e.result.split(":")[0]) for e in trail] == [
        ("notify add", sub.id, "ok"), ("notify remove", "w000000000", "failed"),
        ("notify remove", sub.id, "ok")]  # fmt: skip
    assert trail[2].team == "red"
    assert trail[0].detail == "failed,stuck to https://hooks.example.com"  # no token path


def test_the_cli_adds_lists_and_removes(tmp_path):
    url = str(tmp_path / "storage")
    runner = CliRunner()
    added = runner.invoke(notify_app, ["add", "--url", "http://127.0.0.1:9/h", "--secret",
                                       "hook_key", "--events", "completed", "--storage-root",
                                       url, "-o", "json"])  # fmt: skip
    assert added.exit_code == 0, added.output
    sub_id = json.loads(added.output)["id"]
    listed = runner.invoke(notify_app, ["list", "--storage-root", url])
    assert sub_id in listed.output and "completed" in listed.output, listed.output
    removed = runner.invoke(notify_app, ["remove", sub_id, "--storage-root", url])
    assert removed.exit_code == 0 and "removed" in removed.output
    assert "no webhooks" in runner.invoke(notify_app, ["list", "--storage-root", url]).output


# --- the deliverer, driven directly --------------------------------------------------------------


def deliverer(root: StorageRoot, holder: str = "s1", **kw) -> WebhookDeliverer:
    kw.setdefault("secrets", lambda name, team: SECRET)
    d = WebhookDeliverer(root, holder, backoff=kw.pop("backoff", FAST), scan_s=0.1, **kw)
    d.start(pass_s=0.02)
    return d


def test_each_event_reaches_each_subscription_once_in_order_and_is_audited(tmp_path):
    root = StorageRoot(tmp_path / "root")
    receiver = Receiver(free_port(), fail_every=3)
    receiver.up()
    everyone = add_webhook(receiver.url, secret="k", storage_root=root.url)
    reds = Receiver(free_port())
    reds.up()
    red = add_webhook(reds.url, secret="k", team="red", events=["failed"], storage_root=root.url)
    store = JobStore(root)
    d = deliverer(root)
    try:
        a = JobScript(store, "ja", team="red").run()
        b = JobScript(store, "jb").run()
        a.end_attempt("stuck", "silent").to(JobState.PENDING)
        b.end_attempt(None, decision="completed").to(JobState.COMPLETED)
        a.run().end_attempt("command_failed", "exit 2", "ended").fail("exit 2")
        want = ["ja:0:stuck", "ja:1:failed", "jb:0:completed"]
        eventually(lambda: sorted(receiver.ids()) == want, "every event delivered", 20)
        eventually(lambda: reds.ids() == ["ja:1:failed"], "the red team's failure", 20)
        eventually(lambda: not d.busy, "nothing owed")
        eventually(lambda: NotifyStore(root).settled() == {"ja", "jb"}, "both settled")
    finally:
        d.close()
        receiver.down()
        reds.down()
    got = receiver.ids()
    assert got.index("ja:0:stuck") < got.index("ja:1:failed") and len(got) == 3
    assert receiver.bad_signatures == 0 and receiver.requests > 3  # the 500s were tried again
    header = receiver.headers[got.index("jb:0:completed")]
    assert header["X-Orchestrator-Event"] == "completed"
    assert header["X-Orchestrator-Delivery"] == "jb:0:completed"
    notified = [e for e in audit.read(root) if e.verb == "notify"]
    assert sorted((e.job, e.target, e.detail, e.result) for e in notified) == sorted([
        ("ja", everyone.id, "stuck delivered (attempt 0)", "ok"),
        ("ja", everyone.id, "failed delivered (attempt 1)", "ok"),
        ("jb", everyone.id, "completed delivered (attempt 0)", "ok"),
        ("ja", red.id, "failed delivered (attempt 1)", "ok"),
    ])  # fmt: skip
    assert all(SECRET not in json.dumps(e.model_dump()) for e in audit.read(root))


def test_a_refusing_receiver_is_given_up_after_three_tries_and_the_next_event_goes_on(tmp_path):
    root = StorageRoot(tmp_path / "root")
    answers = iter([Answer(False, False, "HTTP 404")] * 3)
    posted: list[str] = []

    def post(url, body, headers, timeout):
        posted.append(headers["X-Orchestrator-Delivery"])
        return next(answers, Answer(True, False, "HTTP 204"))

    add_webhook("http://127.0.0.1:9/h", secret="k", storage_root=root.url)
    job = JobScript(JobStore(root), "jc").run()
    d = deliverer(root, post=post)
    try:
        job.end_attempt("stuck", "silent").to(JobState.PENDING)
        eventually(lambda: len(posted) == 3, "three tries")
        job.run().end_attempt(None, decision="completed").to(JobState.COMPLETED)
        eventually(lambda: "jc:1:completed" in posted, "the next event")
        eventually(lambda: not d.busy, "nothing owed")
    finally:
        d.close()
    assert posted == ["jc:0:stuck"] * 3 + ["jc:1:completed"]
    results = [(e.detail, e.result) for e in audit.read(root) if e.verb == "notify"]
    assert results == [("stuck given up (attempt 0)", "failed: given up after 3 tries: HTTP 404"),
                       ("completed delivered (attempt 1)", "ok")]  # fmt: skip


def test_an_event_older_than_the_budget_is_given_up_at_its_next_failed_try(tmp_path):
    root = StorageRoot(tmp_path / "root")
    add_webhook(f"http://127.0.0.1:{free_port()}/h", secret="k", storage_root=root.url)
    job = JobScript(JobStore(root), "je").run().end_attempt(None, decision="completed")
    d = deliverer(root, backoff=Backoff(first_s=0.05, cap_s=0.2, give_up_after_s=1.0))
    try:
        job.to(JobState.COMPLETED)
        eventually(lambda: NotifyStore(root).settled() == {"je"}, "given up, and settled")
    finally:
        d.close()
    (given_up,) = NotifyStore(root).deliveries("je").values()
    assert given_up.outcome == "given up" and given_up.tries > 3  # refused connections: retried
    (event,) = [e for e in audit.read(root) if e.verb == "notify"]
    assert event.detail == "completed given up (attempt 0)"
    assert event.result.startswith(f"failed: given up after {given_up.tries} tries: ")


def test_a_missing_secret_holds_the_delivery_until_it_is_set(tmp_path):
    root = StorageRoot(tmp_path / "root")
    receiver = Receiver(free_port())
    receiver.up()
    values: dict[str, str] = {}

    def secrets(name, team):
        if name not in values:
            raise SecretNotFound(f"secret {name!r} is not set in the secret store")
        return values[name]

    add_webhook(receiver.url, secret="hook_key", storage_root=root.url)
    d = deliverer(root, secrets=secrets)
    try:
        JobScript(JobStore(root), "jd").fail("never fits", JobState.DEPLOY_FAILED)
        time.sleep(1.0)
        assert receiver.requests == 0 and d.busy
        values["hook_key"] = SECRET
        eventually(lambda: receiver.ids() == ["jd:0:failed"], "delivered once the secret is set")
    finally:
        d.close()
        receiver.down()


def test_a_delivery_whose_record_fails_to_store_is_recorded_later_never_sent_again(
    tmp_path, monkeypatch
):
    root = StorageRoot(tmp_path / "root")
    receiver = Receiver(free_port())
    receiver.up()
    add_webhook(receiver.url, secret="k", storage_root=root.url)
    real = NotifyStore.record_delivery
    failures = iter([OSError("storage unreachable")] * 3)

    def flaky(self, job_id, seq, delivery):
        if (error := next(failures, None)) is not None:
            raise error
        real(self, job_id, seq, delivery)

    monkeypatch.setattr(NotifyStore, "record_delivery", flaky)
    d = deliverer(root)
    try:
        JobScript(JobStore(root), "jf").fail("exit 1")
        eventually(lambda: NotifyStore(root).settled() == {"jf"}, "recorded, and settled")
    finally:
        d.close()
        receiver.down()
    assert receiver.ids() == ["jf:0:failed"] and receiver.requests == 1
    assert len([e for e in audit.read(root) if e.verb == "notify"]) == 1


def test_one_deliverer_per_root_the_other_takes_over_a_stale_lease(tmp_path):
    root = StorageRoot(tmp_path / "root")
    store = NotifyStore(root)
    assert store.hold("cluster-a", now=1000.0)
    assert not store.hold("cluster-b", now=1010.0)
    assert store.hold("cluster-a", now=1012.0)  # renewed
    assert not store.hold("cluster-b", now=1035.0)
    assert not store.hold("cluster-b", now=1043.0)  # a's went 31 s unrenewed: taken over ...
    assert store.hold("cluster-b", now=1048.0)  # ... and held from the next look
    assert not store.hold("cluster-a", now=1049.0)


def test_two_services_sharing_a_root_deliver_each_event_once(tmp_path):
    root = StorageRoot(tmp_path / "root")
    receiver = Receiver(free_port())
    receiver.up()
    add_webhook(receiver.url, secret="k", storage_root=root.url)
    first, second = deliverer(root, "cluster-a"), deliverer(root, "cluster-b")
    try:
        for n in range(3):
            JobScript(JobStore(root), f"j{n}").fail("exit 1")
        eventually(lambda: sorted(receiver.ids()) == ["j0:0:failed", "j1:0:failed",
                                                      "j2:0:failed"], "delivered")  # fmt: skip
        time.sleep(0.5)
    finally:
        first.close()
        second.close()
        receiver.down()
    assert len(receiver.ids()) == 3


class FakeDeliverer:
    def __init__(self, url: str, holder: str) -> None:
        self.url, self.holder, self.busy, self.started, self.closed = url, holder, True, 0, False

    def start(self) -> None:
        self.started += 1

    def close(self) -> None:
        self.closed = True


def test_the_service_keeps_a_let_go_roots_deliverer_until_nothing_is_owed(monkeypatch):
    from orchestrator.scheduler import webhooks

    monkeypatch.setattr(webhooks, "LEASE_CHECK_S", 0.05)
    made: list[FakeDeliverer] = []

    def make(url: str, holder: str) -> FakeDeliverer:
        made.append(FakeDeliverer(url, holder))
        return made[-1]

    hooks = webhooks.Webhooks("s1", make=make)  # type: ignore[arg-type]
    hooks.watch("/r1")
    hooks.watch("/r1")  # watched already: the same deliverer
    assert [(d.url, d.holder, d.started) for d in made] == [("/r1", "s1", 1)]
    hooks.let_go("/r1")
    time.sleep(0.3)
    assert hooks.busy_roots() == {"/r1"} and not made[0].closed  # still owes
    made[0].busy = False
    eventually(lambda: made[0].closed, "the idle deliverer ended", 5)
    assert hooks.busy_roots() == set()
    hooks.watch("/r1")  # watched again: a new one
    assert len(made) == 2 and made[1].started == 1
    assert webhooks.Webhooks(None).busy_roots() == set()  # outside Ray: none
