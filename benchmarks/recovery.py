"""How long a job takes to recover from a lost node, against pushing it again by hand.

On a simulated GPU cluster (ray.cluster_utils.Cluster: a head and three workers, each with its
own node root and weights cache, as separate machines would have) a 2-node job with a weights
source on S3 (moto on loopback, in its own process) and checkpointing runs a step loop that
checkpoints every --interval steps. Measured in the same run:
- recovery: one rank's node is removed mid-run; from the removal until every rank of the next
  attempt runs again (their first line), with the replacement node's preparation (DEPLOYING to
  RUNNING) and the survivor's (none: it is not prepared again);
- a fresh push of the same job afterwards (what a user without retries does by hand): from
  `push` until every rank runs, with its nodes' preparation;
- what a fault costs in training time with that checkpoint interval: the work since the last
  checkpoint, which is redone, plus the recovery.

With --crash the node crashes instead of leaving (`remove_node(allow_graceful=False)`: its
processes killed, no goodbye to the GCS), so the recovery waits for Ray's health checks to declare
it dead. --runs N repeats the whole measurement on a new cluster and prints p50 and max.

Run: .venv/bin/python benchmarks/recovery.py [--weights-mb 64] [--interval 5] [--step-s 1]
     [--crash] [--runs 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import code_state, serve_moto

from orchestrator.cluster.local import CLUSTER_ENV, embedded_env

TRAIN = """
import os, pathlib, sys, time
rank, attempt = os.environ["BT_NODE_RANK"], os.environ["BT_RETRY_COUNT"]
ck = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
steps, step_s, every = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
done = [int(p.name.split("-")[1]) for p in ck.glob("checkpoint-*")]
start = max(done, default=0)
print(f"running {time.time():.3f} attempt {attempt} from {start}", flush=True)
for step in range(start + 1, steps + 1):
    time.sleep(step_s)
    print(f"step {step} {time.time():.3f}", flush=True)
    if step % every == 0:
        tmp = ck / f".tmp-{step}"
        tmp.mkdir()
        (tmp / "state").write_bytes(os.urandom(1 << 20))
        os.rename(tmp, ck / f"checkpoint-{step}")
"""

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="bench-recovery",
    job=d.TrainingJob(
        image=d.Image(base_image="x"),
        compute=d.Compute(node_count=2, cpu_count=1, memory="256Mi", accelerator="H100:2"),
        runtime=d.Runtime(
            start_commands=["python train.py {steps} {step_s} {interval}"],
            checkpointing_config=d.CheckpointingConfig(enabled=True),
        ),
        weights=[d.WeightsSource(source="s3://bench-weights/model", mount_location="{mount}")],
    ),
)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights-mb", type=int, default=64)
    parser.add_argument("--interval", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--crash", action="store_true", help="the node crashes, not leaves")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    os.environ.update({**embedded_env(), **CLUSTER_ENV, "ORCHESTRATOR_PYTHON": sys.executable})
    parent, child = multiprocessing.Pipe()
    moto = multiprocessing.Process(target=serve_moto, args=(child,), daemon=True)
    moto.start()
    port = parent.recv()
    os.environ.update({
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
    })  # fmt: skip
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("bench-weights")
    for i in range(max(1, args.weights_mb // 16)):
        fs.pipe(f"bench-weights/model/shard-{i}.bin", os.urandom(16 << 20))
    with tempfile.TemporaryDirectory(prefix="orch-bench-recovery-") as tmp:
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")
        results = []
        try:
            for run in range(args.runs):
                results.append(_measure(Path(tmp) / f"run-{run}", args))
                _report(results[-1], args)
        finally:
            parent.send("stop")
            parent.recv()
    if len(results) > 1:
        recoveries = sorted(r["recovery"] for r in results)
        ratios = sorted(r["recovery"] / r["fresh"] for r in results)
        print(f"{len(results)} runs: recovery p50 {statistics.median(recoveries):.2f} s, "
              f"max {recoveries[-1]:.2f} s; vs the fresh push p50 {statistics.median(ratios):.2f}x,"
              f" max {ratios[-1]:.2f}x")  # fmt: skip


def _measure(tmp: Path, args: argparse.Namespace) -> dict:
    from ray.cluster_utils import Cluster

    from orchestrator.client.api import push
    from orchestrator.lifecycle import JobState

    tmp.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dash = s.getsockname()[1]
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": True,
                        "dashboard_host": "127.0.0.1", "dashboard_port": dash},
    )  # fmt: skip
    address, root = f"http://127.0.0.1:{dash}", str(tmp / "storage")
    try:
        for i in range(3):
            disk = tmp / f"node-{i}"
            env = {"ORCHESTRATOR_NODE_ROOT": str(disk / "root"),
                   "ORCHESTRATOR_NODE_CACHE_DIR": str(disk / "weights")}  # fmt: skip
            cluster.add_node(num_cpus=2, num_gpus=2, resources={"accelerator_type:H100": 1},
                             env_vars=env)  # fmt: skip
        cluster.wait_for_nodes()
        job_dir = tmp / "job"
        job_dir.mkdir()
        steps = args.interval * 4 + 2
        (job_dir / "config.py").write_text(textwrap.dedent(CONFIG.format(
            steps=steps, step_s=args.step_s, interval=args.interval, mount=tmp / "mnt",
        )))  # fmt: skip
        (job_dir / "train.py").write_text(TRAIN)
        (job_dir / "data.bin").write_bytes(os.urandom(16 << 20))  # some code to unpack

        job = push(job_dir / "config.py", address=address, storage_root=root, retries=1)
        _running(job, "0")
        # Lose rank 1's node a little after a checkpoint, mid-interval.
        target = args.interval + args.interval // 2
        while not _steps(job, 1) or max(_steps(job, 1)) < target:
            time.sleep(0.05)
        last_checkpoint = max(s for s in _steps(job, 1) if s % args.interval == 0)
        since_checkpoint = _steps(job, 1)[max(_steps(job, 1))] - _steps(job, 1)[last_checkpoint]
        lost = job.details().nodes[1].node_id
        node = next(n for n in cluster.worker_nodes if n.node_id == lost)
        removed = time.time()
        cluster.remove_node(node, allow_graceful=not args.crash)
        again = _running(job, "1")
        assert job.wait(timeout=600) == JobState.COMPLETED, job.logs()[-20:]
        status = job.details()
        replaced_prep = _span(status.history, JobState.DEPLOYING, JobState.RUNNING, last=True)
        first = status.attempts[0]
        after = [e for e in status.history if e.at >= removed]
        steps = [("the fault recorded (attempt 0 ended)", first.ended_at or removed)]
        steps += [(f"{e.state.value}: {(e.reason or '')[:60]}", e.at) for e in after]
        steps.append(("every rank of attempt 1 running", again))
        timeline = sorted(((what, at - removed) for what, at in steps), key=lambda w: w[1])
        assert [n.prepared_for for n in status.nodes] == [0, 1], status.nodes

        disk = tmp / "node-3"  # a spare again, for the fresh push's second node
        env = {"ORCHESTRATOR_NODE_ROOT": str(disk / "root"),
               "ORCHESTRATOR_NODE_CACHE_DIR": str(disk / "weights")}  # fmt: skip
        cluster.add_node(num_cpus=2, num_gpus=2, resources={"accelerator_type:H100": 1},
                         env_vars=env)  # fmt: skip
        cluster.wait_for_nodes()
        pushed = time.time()
        fresh_job = push(job_dir / "config.py", address=address, storage_root=root)
        fresh = _running(fresh_job, "0") - pushed
        fresh_prep = _span(fresh_job.refresh().history, JobState.DEPLOYING, JobState.RUNNING)
        fresh_job.stop()
        return {
            "recovery": again - removed,
            "replaced_prep": replaced_prep,
            "fresh": fresh,
            "fresh_prep": fresh_prep,
            "since_checkpoint": since_checkpoint,
            "timeline": timeline,
        }
    finally:
        cluster.shutdown()


def _lines(job, rank: int) -> list[str]:
    prefix = f"[rank {rank} "
    return [line.split("] ", 1)[1] for line in job.logs() if line.startswith(prefix)]


def _steps(job, rank: int) -> dict[int, float]:
    found = {}
    for line in _lines(job, rank):
        if line.startswith("step "):
            _, step, at = line.split()
            found[int(step)] = float(at)
    return found


def _running(job, attempt: str, timeout: float = 600) -> float:
    """When the last rank of `attempt` printed its first line (its own clock)."""
    deadline = time.monotonic() + timeout
    while True:
        starts = [
            float(line.split()[1])
            for rank in (0, 1)
            for line in _lines(job, rank)
            if line.startswith("running ") and line.split()[3] == attempt
        ]
        if len(starts) == 2:
            return max(starts)
        if time.monotonic() > deadline or job.status().is_terminal:
            raise RuntimeError("\n".join(job.logs()[-30:]))
        time.sleep(0.05)


def _span(history, start, end, last: bool = False) -> float:
    events = list(reversed(history)) if last else history
    end_at = next(e.at for e in events if e.state == end)
    return end_at - next(e.at for e in events if e.state == start and e.at <= end_at)


def _report(r: dict, args: argparse.Namespace) -> None:
    interval_s = args.interval * args.step_s
    print(f"code: {code_state()}; weights {args.weights_mb} MB on S3 (moto), code archive 16 MB,"
          f" checkpoint every {args.interval} steps of {args.step_s:g} s")  # fmt: skip
    print(f"fresh push of the same job:       {r['fresh']:.2f} s to every rank running "
          f"(its nodes' preparation {r['fresh_prep']:.2f} s)")  # fmt: skip
    how = "crashed" if args.crash else "lost"
    print(f"recovery from a {how} node: {r['recovery']:.2f} s to every rank running again "
          f"= {r['recovery'] / r['fresh']:.2f}x the fresh push")  # fmt: skip
    print(f"  the replacement's preparation:  {r['replaced_prep']:.2f} s (restore included)")
    print("  the survivor's preparation:     0.00 s (not prepared again) = 0% of a fresh node's")
    for what, at in r["timeline"]:
        print(f"    +{at:5.2f} s  {what}")
    print(f"training time lost to this fault: {r['since_checkpoint']:.2f} s redone since the "
          f"last checkpoint + {r['recovery']:.2f} s recovery")  # fmt: skip
    print(
        f"expected per fault with a {interval_s:g} s checkpoint interval: "
        f"{interval_s / 2 + r['recovery']:.1f} s (half an interval redone + the recovery)"
    )


if __name__ == "__main__":
    main()
