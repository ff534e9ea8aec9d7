"""The ray-train-mnist recipe under the orchestrator, against bare Ray Train on the same cluster.

On a simulated cluster (ray.cluster_utils.Cluster: a 1-CPU head with the dashboard and two
2-CPU workers, each with its own node root) the recipe's unchanged `train.py` runs, in
alternating rounds:
- bare: a plain driver subprocess (`python train.py` with RAY_ADDRESS: `TorchTrainer.fit()`,
  Train's own placement group);
- job submit: the same script as a bare Ray job (`JobSubmissionClient.submit_job` with the
  recipe as `working_dir`; the `ray job submit` CLI adds its own start-up, about 0.9 s);
- orchestrator: `push` of `recipes/ray-train-mnist/config.py` (a `ray_train` job with
  checkpointing: workers in the job's placement group, checkpoints on each node's disk and
  uploaded, every report stored).
Measured per path: the training step time (rank 0's `step_ms` per epoch, first epoch left out),
the time from the start (subprocess, `submit_job`, `push`) until the first worker runs (its
`worker 0/2 running` line), and the whole run. Ratios are against the bare paths of the same run.
The bare paths pass `--storage-path` (a directory per round): Train would otherwise resume the
previous round's finished run from `~/ray_results`.

Run: .venv/bin/python benchmarks/ray_train.py [--rounds 3] [--poll 0.05]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from common import code_state

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "ray-train-mnist"
FIRST_WORKER = re.compile(r"worker 0/\d+ running")
STEP_MS = re.compile(r"epoch (\d+)/\d+ loss \S+ accuracy (\S+) step_ms (\S+)")
# What the recipe's config sets for the job; the bare paths get the same.
RECIPE_ENV = {"OMP_NUM_THREADS": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


class Watch:
    """Lines of a run as they come, each with the time it was seen."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def add(self, text: str) -> None:
        now = time.monotonic()
        self.lines.extend((now, line) for line in text.splitlines())

    def first(self, pattern: re.Pattern) -> float | None:
        return next((t for t, line in self.lines if pattern.search(line)), None)

    def steps(self) -> list[float]:
        found = {int(m[1]): float(m[3]) for _, line in self.lines if (m := STEP_MS.search(line))}
        return [found[e] for e in sorted(found) if e > 1]  # epoch 1 warms up

    def accuracy(self) -> str:
        final = [line for _, line in self.lines if "final test accuracy" in line]
        return final[-1].rsplit(" ", 1)[1] if final else "-"


def bare_driver(gcs: str, storage: Path) -> dict:
    watch = Watch()
    env = {**os.environ, **RECIPE_ENV, "RAY_ADDRESS": gcs}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--storage-path", str(storage)], cwd=RECIPE, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        watch.add(line)
    assert proc.wait() == 0, "\n".join(line for _, line in watch.lines[-30:])
    return _result(watch, t0, time.monotonic())


def job_submit(dashboard: str, gcs: str, storage: Path, args: argparse.Namespace) -> dict:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(dashboard)
    watch = Watch()
    t0 = time.monotonic()
    job_id = client.submit_job(
        # This python (Ray, torch); RAY_ADDRESS set (Ray's job supervisor gives the machine's
        # newest cluster, maybe another's); a storage path of its own, or Train resumes the last
        entrypoint=f"RAY_ADDRESS={gcs} {sys.executable} train.py --storage-path {storage}",
        runtime_env={"working_dir": str(RECIPE), "env_vars": RECIPE_ENV},
    )
    seen = 0
    while True:
        status = client.get_job_status(job_id)
        logs = client.get_job_logs(job_id)
        watch.add(logs[seen:])
        seen = len(logs)
        if status.is_terminal():
            break
        time.sleep(_poll_s(watch, args))
    ended = time.monotonic()
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    return _result(watch, t0, ended)


def orchestrator_push(dashboard: str, root: str, args: argparse.Namespace) -> dict:
    from orchestrator.client.api import push
    from orchestrator.lifecycle import JobState

    watch = Watch()
    t0 = time.monotonic()
    job = push(RECIPE / "config.py", address=dashboard, storage_root=root)
    pushed = time.monotonic() - t0
    seen = 0
    while True:
        logs = job.logs()
        watch.add("\n".join(logs[seen:]))
        seen = len(logs)
        if job.refresh().state.is_terminal:
            break
        time.sleep(_poll_s(watch, args))
    ended = time.monotonic()
    logs = job.logs()
    watch.add("\n".join(logs[seen:]))
    status = job.details()
    history = "\n".join(f"  {h.state.value}: {h.reason}" for h in status.history)
    assert status.state == JobState.COMPLETED, (
        f"job {job.id} ended {status.state.value}:\n{history}\n" + "\n".join(logs[-30:])
    )
    result = _result(watch, t0, ended)
    result["push_returned"] = pushed
    result["reports"] = sum(len(r.reports) for r in job.metrics().train_reports)
    result["checkpoints"] = len({m.name for m in job.checkpoints() if not m.top_level})
    return result


def _poll_s(watch: Watch, args: argparse.Namespace) -> float:
    """Fine until the first worker runs; then 1 s, so that reading the logs takes little of
    the 2 cores the steps run on (the bare driver's lines come by a pipe, at no cost)."""
    return args.poll if watch.first(FIRST_WORKER) is None else 1.0


def _result(watch: Watch, t0: float, ended: float) -> dict:
    first = watch.first(FIRST_WORKER)
    assert first is not None and watch.steps(), "\n".join(line for _, line in watch.lines[-40:])
    return {"first_worker": first - t0, "total": ended - t0, "steps": watch.steps(),
            "accuracy": watch.accuracy()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each path")
    parser.add_argument(
        "--poll", type=float, default=0.05, help="log poll interval until the first worker (s)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="orch-bench-ray-train-"))
    os.environ.pop("RAY_ADDRESS", None)  # never a developer's own cluster
    os.environ["ORCHESTRATOR_HOME"] = str(tmp / "home")  # its own token, before Ray is imported
    from orchestrator.cluster.local import CLUSTER_ENV, use_embedded_env

    use_embedded_env()
    os.environ.update({**CLUSTER_ENV, "ORCHESTRATOR_PYTHON": sys.executable})
    from ray.cluster_utils import Cluster

    from orchestrator.cluster.ray_start import free_ports

    port, gcs_port, agent, metrics = free_ports(4)
    # Ray's temp dir of its own, out of the shared /tmp/ray. (It does not keep Ray's job
    # supervisor from handing a job's driver the machine's newest cluster: see job_submit.)
    temp_dir = tempfile.mkdtemp(prefix="rtb-", dir="/tmp")  # short: Unix socket paths
    head = {"num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "temp_dir": temp_dir,
            "dashboard_port": port, "gcs_server_port": gcs_port,
            "dashboard_agent_listen_port": agent, "metrics_export_port": metrics}  # fmt: skip
    cluster = Cluster(initialize_head=True, head_node_args=head)
    dashboard = f"http://127.0.0.1:{port}"
    paths: dict[str, list[dict]] = {"bare": [], "job submit": [], "orchestrator": []}
    print(f"code: {code_state()}; {os.cpu_count()} CPUs; {args.rounds} rounds", flush=True)
    try:
        for i in range(2):
            env = {"ORCHESTRATOR_NODE_ROOT": str(tmp / f"node-{i}")}
            cluster.add_node(num_cpus=2, env_vars=env, temp_dir=temp_dir)
        cluster.wait_for_nodes()
        _warm(cluster.address)
        for r in range(args.rounds):
            gcs, root = cluster.address, str(tmp / "storage")
            runs = [
                ("bare", partial(bare_driver, gcs, tmp / f"bare-{r}")),
                ("job submit", partial(job_submit, dashboard, gcs, tmp / f"submit-{r}", args)),
                ("orchestrator", partial(orchestrator_push, dashboard, root, args)),
            ]
            if r % 2:
                runs.reverse()
            for name, measure in runs:
                result = measure()
                paths[name].append(result)
                print(f"round {r + 1} {name:12s} first worker {result['first_worker']:.2f} s, "
                      f"total {result['total']:.1f} s, step p50 "
                      f"{statistics.median(result['steps']):.2f} ms, "
                      f"accuracy {result['accuracy']}", flush=True)  # fmt: skip
    finally:
        cluster.shutdown()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(temp_dir, ignore_errors=True)
    _report(paths)


def _warm(gcs: str) -> None:
    """Import torch and Ray Train once in a subprocess, so the first round pays no cold page
    cache."""
    subprocess.run([sys.executable, "-c", "import torch, ray.train.torch, sklearn.datasets"],
                   check=True, env={**os.environ, "RAY_ADDRESS": gcs})  # fmt: skip


def _report(paths: dict[str, list[dict]]) -> None:
    def p50(name: str, key: str) -> float:
        return statistics.median(r[key] for r in paths[name])

    def step(name: str) -> float:
        return statistics.median(s for r in paths[name] for s in r["steps"])

    print("\npath          step p50   first worker p50   whole run p50")
    for name in paths:
        print(f"{name:12s} {step(name):7.2f} ms {p50(name, 'first_worker'):11.2f} s "
              f"{p50(name, 'total'):13.1f} s")  # fmt: skip
    print(
        f"\nstep time, orchestrator / bare driver: {step('orchestrator') / step('bare'):.3f}x "
        f"(vs job submit {step('orchestrator') / step('job submit'):.3f}x; goal <= 1.05x)"
    )
    per_round = [
        statistics.median(o["steps"]) / statistics.median(b["steps"])
        for o, b in zip(paths["orchestrator"], paths["bare"], strict=True)
    ]
    print("step time per round, orchestrator / bare: "
          + ", ".join(f"{r:.2f}x" for r in per_round)
          + f" (median {statistics.median(per_round):.3f}x)")  # fmt: skip
    for base in ("bare", "job submit"):
        o, b = p50("orchestrator", "first_worker"), p50(base, "first_worker")
        print(f"start to first worker, orchestrator / {base}: {o / b:.2f}x (+{o - b:.2f} s)")
    last = paths["orchestrator"][-1]
    print(
        f"orchestrator: push returned after {p50('orchestrator', 'push_returned'):.2f} s; "
        f"last run stored {last['reports']} reports and {last['checkpoints']} checkpoints"
    )


if __name__ == "__main__":
    main()
