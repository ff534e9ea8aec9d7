"""The job queue on a simulated GPU cluster: a head and four workers with 2 H100 each, two teams
with quotas. Real Ray, real controllers (a root's first job a Ray job, the rest threads of the
controller host), one queue service per storage root.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray
from conftest import controller_host_up, eventually, make_job, simulated_cluster
from ray.cluster_utils import Cluster
from ray.job_submission import JobSubmissionClient

from orchestrator.agents.services import NAMESPACE
from orchestrator.client.api import push
from orchestrator.client.books import by_team, usage
from orchestrator.client.jobs import JobHandle
from orchestrator.client.queue import queue, set_capacity, update_priority
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.service import QUEUE_SERVICE_NAME, start_queue_service
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import QueueEntry, QueueStore
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.cluster  # starts Ray itself (a simulated or local cluster)

WORKERS = 4


@pytest.fixture(scope="module")
def h100s(orchestrator_home) -> Iterator[tuple[Cluster, str]]:
    cluster, dashboard_url = simulated_cluster()
    try:
        for _ in range(WORKERS):
            cluster.add_node(num_cpus=2, num_gpus=2, resources={"accelerator_type:H100": 1})
        cluster.wait_for_nodes()
        yield cluster, dashboard_url
    finally:
        cluster.shutdown()


@contextlib.contextmanager
def connected(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as a driver of the simulated cluster (to find or kill the queue service)."""
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def job(directory: Path, command: str, *, team: str | None = None, nodes: int = 1,
        priority: int = 0, checkpoints: bool = False, files: dict | None = None,
        ) -> Path:  # fmt: skip
    return make_job(
        directory,
        f"""
        from truss_train import definitions as d
        project = d.TrainingProject(
            name="queue", team_name={team!r},
            job=d.TrainingJob(
                image=d.Image(base_image="python:3.11"), priority={priority},
                compute=d.Compute(node_count={nodes}, cpu_count=1, memory="128Mi",
                                  accelerator="H100:2"),
                runtime=d.Runtime(start_commands=[{command!r}],
                                  checkpointing_config=d.CheckpointingConfig(enabled={checkpoints})),
            ),
        )
        """,
        files,
    )


def team_counter(node, what: str, team: str) -> float:
    """`ray_orchestrator_team_<what>_total` of `team` as the node's Ray metrics agent serves
    it (what a Prometheus scraping the cluster reads), summed over its other labels."""
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return 0.0
    prefix = f"ray_orchestrator_team_{what}_total{{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and f'team="{team}"' in line)  # fmt: skip


def running_at(handle: JobHandle) -> float:
    return next(e.at for e in handle.details().history if e.state == JobState.RUNNING)


def deploys(handle: JobHandle) -> int:
    return sum(1 for e in handle.details().history if e.state == JobState.DEPLOYING)


WAIT_FOR_GATE = (
    "python -c \"import pathlib,time\nwhile not pathlib.Path('{gate}').exists(): time.sleep(0.1)\""
)


def test_the_queue_orders_by_priority_then_push_and_survives_its_service(
    h100s, tmp_path, monkeypatch
):
    cluster, address = h100s
    root = str(tmp_path / "storage")
    gate = tmp_path / "gate"
    blocker = push(job(tmp_path / "blocker", WAIT_FOR_GATE.format(gate=gate), nodes=4),
                   address=address, storage_root=root)  # fmt: skip
    eventually(lambda: blocker.status() == JobState.RUNNING, "the blocker to run", 60)
    pushed = {}
    for name, priority in (("first", 0), ("second", 0), ("urgent", 5)):  # 3 nodes: one at a time
        pushed[name] = push(job(tmp_path / name, "sleep 0.2", team="vision", nodes=3,
                                priority=priority), address=address, storage_root=root)  # fmt: skip
    ids = {handle.id: name for name, handle in pushed.items()}

    def order() -> list[str]:
        return [ids[row["job_id"]] for row in queue(storage_root=root) if row["position"]]

    eventually(lambda: order() == ["urgent", "first", "second"], "the queue's order", 60)
    why = (
        "waiting in the queue (position 3): needs 3 nodes with 2 H100, 1 CPU, 128.0 MiB memory "
        "free: 0 such nodes free"
    )
    eventually(lambda: pushed["second"].details().history[-1].reason == why, "its reason", 30)
    assert pushed["second"].status() == JobState.PENDING
    assert update_priority(pushed["second"].id, 9, storage_root=root) == 9  # PENDING: allowed
    eventually(lambda: order() == ["second", "urgent", "first"], "the new order", 30)
    with pytest.raises(Exception, match="only a PENDING job"):
        update_priority(blocker.id, 9, storage_root=root)

    with connected(cluster, monkeypatch):  # the service dies; the controllers start another
        name = QUEUE_SERVICE_NAME
        old = ray.get_actor(name, namespace=NAMESPACE)
        ray.kill(old)
        eventually(lambda: _actor_id(name) not in (None, old._actor_id), "a new service", 30)
    assert order() == ["second", "urgent", "first"]  # rebuilt from the storage root

    stopped = push(job(tmp_path / "stopped", "echo never", nodes=3), address=address,
                   storage_root=root)  # fmt: skip
    eventually(lambda: stopped.status() == JobState.PENDING, "the fourth job to queue", 60)
    assert stopped.stop() == JobState.STOPPED
    assert deploys(stopped) == 0 and not any("never" in line for line in stopped.logs())
    queued = QueueStore(StorageRoot(root))
    eventually(lambda: stopped.id not in {e.job_id for e in queued.entries()},
               "the stopped job to leave the queue", 30)  # fmt: skip

    gate.touch()
    for handle in (blocker, *pushed.values()):
        assert handle.wait(timeout=120) == JobState.COMPLETED, (
            handle.details().failure,
            handle.logs()[-5:],
        )
    started = sorted(pushed, key=lambda name: running_at(pushed[name]))
    assert started == ["second", "urgent", "first"]
    assert all(deploys(handle) == 1 for handle in pushed.values())  # admitted once each
    stored = QueueStore(StorageRoot(root))  # each lets go just after its end is recorded
    eventually(lambda: stored.entries() == [], "every job to leave the queue", 30)


def controller_processes(job_ids: set[str]) -> set[str]:
    """The jobs of `job_ids` that have a process on this machine (their controller's command
    line names the job; so does a JobSupervisor's)."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        found |= {job_id for job_id in job_ids if job_id in line}
    return found


def test_queued_jobs_hold_no_process_and_answer_at_once(h100s, tmp_path, monkeypatch):
    cluster, address = h100s
    root = str(tmp_path / "storage")
    gate = tmp_path / "gate"
    blocker = push(job(tmp_path / "blocker", WAIT_FOR_GATE.format(gate=gate), nodes=4),
                   address=address, storage_root=root)  # fmt: skip
    try:
        eventually(lambda: blocker.status() == JobState.RUNNING, "the blocker to run", 60)
        queued = [push(job(tmp_path / f"q{i}", "echo ran", nodes=4), address=address,
                       storage_root=root) for i in range(6)]  # fmt: skip
        ids = {handle.id for handle in queued}
        # In the queue the moment push returns: listed, re-prioritised, stopped.
        assert {row["job_id"] for row in queue(storage_root=root)} == ids
        last = queued[-1]
        assert update_priority(last.id, 7, storage_root=root) == 7
        assert queued[0].stop(timeout=10) == JobState.STOPPED
        assert not any("ran" in line for line in queued[0].logs())
        eventually(lambda: all(h.status() == JobState.PENDING for h in queued[1:]), "PENDING", 30)
        assert "waiting in the queue (position 1)" in last.details().history[-1].reason

        assert controller_processes(ids) == set()  # no controller, no Ray job, no supervisor
        ray_jobs = {j.submission_id for j in JobSubmissionClient(address).list_jobs()}
        assert ray_jobs & ids == set() and blocker.id in ray_jobs

        with connected(cluster, monkeypatch):  # the service's process dies: Ray restarts it
            service = ray.get_actor(QUEUE_SERVICE_NAME, namespace=NAMESPACE)
            ray.kill(service, no_restart=False)
    finally:
        gate.touch()  # the jobs after this one need the nodes
    for handle in queued[1:]:
        assert handle.wait(timeout=120) == JobState.COMPLETED, handle.logs()
    assert queued[0].status() == JobState.STOPPED
    assert min(queued[1:], key=running_at) is last  # its priority counted
    info = JobSubmissionClient(address).get_job_info(last.id)  # a running job is a Ray job
    assert info.metadata["orchestrator_project"] == "queue"


def _actor_id(name: str):
    try:
        return ray.get_actor(name, namespace=NAMESPACE)._actor_id
    except ValueError:
        return None


TRAIN = """
import os, pathlib, signal, sys, time
from orchestrator import mark_checkpoint_complete
attempt = int(os.environ["BT_RETRY_COUNT"])
ck = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
done = [int(p.name.split("-")[1]) for p in ck.glob("checkpoint-*") if (p / "state").exists()]
step = max(done, default=0)
print(f"attempt {attempt} resumes at step {step}", flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))

def save(step):
    path = ck / f"checkpoint-{step}"
    path.mkdir()
    (path / "state").write_text(str(step))
    mark_checkpoint_complete(path)

while not stop and (attempt == 0 or step < max(done) + 2):
    time.sleep(0.2)
    if stop:
        break
    step += 1
    if step % 5 == 0 or attempt > 0:
        save(step)
if stop:
    # What it had when told to give way, under one name on every rank (as a DDP trainer's ranks
    # agree on their step; these two count steps apart and may be one apart when told).
    save(5000)
    print("saved on SIGTERM", flush=True)
    sys.exit(143)
print(f"finished at step {step}", flush=True)
"""


def test_a_borrowing_job_gives_way_to_its_owners_and_resumes_from_its_checkpoint(h100s, tmp_path):
    _, address = h100s
    root = str(tmp_path / "storage")
    set_capacity("vision", gpus={"H100": 4}, storage_root=root)  # 2 nodes each
    set_capacity("nlp", gpus={"H100": 4}, storage_root=root)
    gate = tmp_path / "gate"
    own = push(job(tmp_path / "own", WAIT_FOR_GATE.format(gate=gate), team="vision", nodes=2),
               address=address, storage_root=root)  # fmt: skip
    eventually(lambda: own.status() == JobState.RUNNING, "vision's own job to run", 60)
    borrower = push(job(tmp_path / "borrower", "python train.py", team="vision", nodes=2,
                        checkpoints=True, files={"train.py": TRAIN}),
                    address=address, storage_root=root)  # fmt: skip
    eventually(lambda: any("checkpoint-5" in line for line in borrower.logs()),
               "the borrower's first checkpoint", 60)  # fmt: skip
    assert any("borrowed" in line for line in borrower.logs())  # nlp is idle: vision borrows it

    owner = push(job(tmp_path / "owner", "sleep 0.2", team="nlp", nodes=2),
                 address=address, storage_root=root)  # fmt: skip
    assert owner.wait(timeout=120) == JobState.COMPLETED, owner.logs()
    assert borrower.wait(timeout=120) == JobState.COMPLETED, borrower.logs()
    gate.touch()
    assert own.wait(timeout=60) == JobState.COMPLETED

    details = borrower.details()
    first, second = details.attempts  # preempted once, never twice in a row
    assert (first.cause, second.cause) == ("preempted_by_job", None)
    # It came back once capacity was idle again, not on the room it freed before its owner ran.
    restarted = [e.at for e in details.history if e.state == JobState.RUNNING][1]
    assert restarted >= running_at(owner) and deploys(owner) == 1
    assert first.reason.startswith(f"preempted by {owner.id}: borrowed capacity")
    assert second.resumed_from is not None
    saved = int(second.resumed_from.split("-")[1])
    assert saved == 5000  # the checkpoint it wrote when told to give way
    assert f"attempt 1 resumes at step {saved}" in "\n".join(borrower.logs())
    states = [e.state for e in details.history]
    assert states.count(JobState.RUNNING) == 2 and JobState.PENDING in states[states.index(
        JobState.RUNNING):]  # fmt: skip
    said = "\n".join(owner.logs())  # each PENDING reason as it changed
    assert f"PENDING: waiting in the queue (position 1): preempting {borrower.id}" in said
    assert own.details().attempts[0].cause is None  # within its quota: never preempted

    # The books of both teams: the borrower held its nodes twice, waited while its owner ran,
    # and lost nothing (it resumed from what it saved on SIGTERM, stored after its end).
    given_back, again = details.holds
    owner_ran = owner.details().holds[0]
    assert given_back.until <= owner_ran.since and again.since >= owner_ran.until
    books = borrower.usage()
    assert books.waiting_s >= again.since - given_back.until >= owner_ran.until - owner_ran.since
    assert second.resumed_at >= first.ended_at and books.lost.held_s == 0
    held = (given_back.until - given_back.since) + (again.until - again.since)
    assert books.usage.gpu_s == {"H100": pytest.approx(2 * 2 * held)}
    teams = by_team(usage(storage_root=root))
    assert (teams["vision"]["jobs"], teams["nlp"]["jobs"]) == (2, 1)
    assert teams["nlp"]["usage"] == owner.usage().usage
    # ... and the queue service's per-team counter in Prometheus, as the head's agent serves it
    nlp = owner.usage().usage.gpu_s["H100"]
    eventually(lambda: abs(team_counter(h100s[0].head_node, "gpu_seconds", "nlp") - nlp) <= 12,
               f"nlp's {nlp:.0f} H100-seconds in Prometheus", 30)  # fmt: skip


def test_a_controller_that_dies_ends_its_job_failed_and_lets_go(h100s, tmp_path):
    _, address = h100s
    root = str(tmp_path / "storage")
    victim = push(job(tmp_path / "victim", "sleep 300", nodes=4), address=address,
                  storage_root=root)  # fmt: skip
    eventually(lambda: victim.status() == JobState.RUNNING, "the job to run", 60)
    after = push(job(tmp_path / "after", "sleep 0.1", nodes=4), address=address, storage_root=root)
    eventually(lambda: after.status() == JobState.PENDING, "the next job to wait", 60)

    pid = victim._client().get_job_info(victim.id).driver_info.pid  # the controller we started
    os.kill(int(pid), signal.SIGKILL)
    stored = JobStore(StorageRoot(root))  # as stored, before any client looks at Ray's view
    eventually(lambda: stored.status(victim.id).state == JobState.FAILED, "FAILED", 60)
    cause = stored.status(victim.id).failure.cause
    assert cause.startswith(f"the job's controller (Ray job {victim.id}) died while RUNNING")
    assert after.wait(timeout=90) == JobState.COMPLETED  # what the dead one held was let go


def ray_row(address: str, job_id: str):
    """The job as Ray's Job API shows it (the dashboard's Jobs page, `ray job status`)."""
    return JobSubmissionClient(address).get_job_info(job_id)


def host_pid(address: str) -> int:
    from ray.util.state import list_actors

    from orchestrator.controller.host import HOST_NAME

    (host,) = list_actors(address=address, filters=[("name", "=", HOST_NAME),
                                                    ("state", "=", "ALIVE")])  # fmt: skip
    return int(host.pid)


def test_an_admitted_job_runs_its_controller_in_the_host_and_shows_as_a_ray_job(h100s, tmp_path):
    _, address = h100s
    root = str(tmp_path / "storage")
    first = push(job(tmp_path / "first", "echo first"), address=address, storage_root=root)
    assert first.wait(timeout=120) == JobState.COMPLETED  # its own Ray job: the root's service
    eventually(lambda: controller_host_up(address), "the controller host", 60)  # it started it
    sleeper = push(job(tmp_path / "sleeper", "python -c 'import time; time.sleep(600)'"),
                   address=address, storage_root=root)  # fmt: skip
    eventually(lambda: sleeper.status() == JobState.RUNNING, "the hosted job to run", 60)
    entry = QueueStore(StorageRoot(root)).entry(sleeper.id)
    assert entry.hosted and entry.hosted_by is not None
    assert controller_processes({sleeper.id}) == set()  # no process of its own, no supervisor
    row = ray_row(address, sleeper.id)
    assert row.status.value == "RUNNING" and row.entrypoint.startswith(": 'queue/")
    assert row.metadata["job_name"] == f"queue/{sleeper.id}"
    assert row.metadata["orchestrator_controller"] == "hosted"
    said = JobSubmissionClient(address).get_job_logs(sleeper.id)  # `ray job logs`
    assert "] DEPLOYING: preparing 1 node(s)" in said and "] RUNNING: running 1" in said, said

    assert sleeper.stop(timeout=60) == JobState.STOPPED
    assert any("stopped by user" in line for line in sleeper.logs())
    eventually(lambda: ray_row(address, sleeper.id).status.value == "STOPPED", "row STOPPED", 10)
    quick = push(job(tmp_path / "quick", "echo quick-ran"), address=address, storage_root=root)
    assert quick.wait(timeout=60) == JobState.COMPLETED, quick.logs()
    eventually(lambda: QueueStore(StorageRoot(root)).entry(quick.id) is None, "its room let go", 10)
    eventually(lambda: ray_row(address, quick.id).status.value == "SUCCEEDED", "SUCCEEDED", 10)

    # Ray's own CLI stops a hosted job too: `ray job stop` returns once the row has ended.
    again = push(job(tmp_path / "again", "python -c 'import time; time.sleep(600)'"),
                 address=address, storage_root=root)  # fmt: skip
    eventually(lambda: again.status() == JobState.RUNNING, "the second hosted job to run", 60)
    assert ray_row(address, again.id).metadata["orchestrator_controller"] == "hosted"
    ray_cli = Path(sys.executable).parent / "ray"
    stopped = subprocess.run([str(ray_cli), "job", "stop", "--address", address, again.id],
                             capture_output=True, text=True, timeout=90)  # fmt: skip
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 0 and f"Job '{again.id}' was stopped" in said, said
    assert again.wait(timeout=30) == JobState.STOPPED
    assert any("stopped by user" in line for line in again.logs())


def test_a_job_whose_controller_host_dies_fails_with_why_and_lets_go(h100s, tmp_path):
    _, address = h100s
    root = str(tmp_path / "storage")
    first = push(job(tmp_path / "first", "echo first"), address=address, storage_root=root)
    assert first.wait(timeout=120) == JobState.COMPLETED
    victim = push(job(tmp_path / "victim", "sleep 307", nodes=4), address=address,
                  storage_root=root)  # fmt: skip
    eventually(lambda: victim.status() == JobState.RUNNING, "the hosted job to run", 60)
    after = push(job(tmp_path / "after", "echo after-ran", nodes=4), address=address,
                 storage_root=root)  # fmt: skip
    eventually(lambda: after.status() == JobState.PENDING, "the next job to wait", 60)

    def victims() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if "sleep 307" in " ".join(
            p.info["cmdline"] or [])]  # fmt: skip

    eventually(lambda: len(victims()) >= 4, "the victim's four ranks' commands to run", 30)
    commands = victims()
    os.kill(host_pid(address), signal.SIGKILL)
    stored = JobStore(StorageRoot(root))
    eventually(lambda: stored.status(victim.id).state == JobState.FAILED, "FAILED", 60)
    cause = stored.status(victim.id).failure.cause
    assert cause.startswith("the controller host's process on the head ended"), cause
    assert after.wait(timeout=90) == JobState.COMPLETED, after.logs()  # its nodes were let go
    eventually(lambda: QueueStore(StorageRoot(root)).entry(after.id) is None, "after gone", 10)
    assert ray_row(address, victim.id).status.value == "FAILED"
    # Its agents died with the host's placement groups: Ray SIGKILLs each agent's guard, and
    # the guard's watcher ends the command's group.
    _, alive = psutil.wait_procs(commands, timeout=30)
    assert not alive, f"the dead job's commands still run: {alive}"


def test_fifty_small_jobs_from_three_teams_all_run_within_their_quotas(
    h100s, tmp_path, monkeypatch
):
    """The service alone (each job's controller played by this test): every job admitted once,
    none lost, and a team beyond its quota only on capacity lent as borrowed."""
    cluster, _ = h100s
    root = str(tmp_path / "storage")
    quotas = {"a": 4, "b": 2, "c": 2}
    store = QueueStore(StorageRoot(root))
    for team, gpus in quotas.items():
        store.set_quota(team, {"GPU:H100": gpus})
    with connected(cluster, monkeypatch):
        service = start_queue_service(tick_s=0.1)
        for i in range(50):
            team = "abc"[i % 3]
            entry = QueueEntry(job_id=f"j{i:02d}", team=team, pushed_at=float(i),
                               bundle={"CPU": 1, "GPU:H100": 1 + i % 2})  # fmt: skip
            ray.get(service.enqueue.remote(root, entry))
        admitted: dict[str, float] = {}
        finished: set[str] = set()
        deadline = time.monotonic() + 60
        while len(finished) < 50:
            assert time.monotonic() < deadline, f"{50 - len(finished)} jobs never ran"
            view = ray.get(service.view.remote(root)).entries
            in_use = {team: 0.0 for team in quotas}
            for e in (viewed.entry for viewed in view):
                if e.state != "admitted":
                    continue
                admitted.setdefault(e.job_id, time.monotonic())
                if not e.borrowed:
                    in_use[e.team] += e.bundle["GPU:H100"]
            assert all(in_use[t] <= quotas[t] for t in quotas), in_use  # owned: within quota
            for job_id, since in list(admitted.items()):
                if job_id not in finished and time.monotonic() - since > 0.3:  # it ran
                    ray.get(service.release.remote(root, job_id))
                    finished.add(job_id)
            time.sleep(0.05)
        assert ray.get(service.view.remote(root)).entries == ()
        ray.kill(service)
