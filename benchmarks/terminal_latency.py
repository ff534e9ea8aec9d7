"""How quickly `orchestrator shell` answers a keystroke, against a bare Ray Client call.

Starts a private embedded cluster and a job that sleeps, attaches `orchestrator shell` to it on a
pseudo-terminal (pexpect, as a person's terminal), and measures:
- keystroke echo: one character sent until the PTY's echo of it comes back through the relay;
- command round trip: `echo $((...))` + Enter until its output line comes back;
- attach: the CLI started until the remote prompt appears;
against the least any relay over Ray Client must do: one actor call's round trip from a Ray
Client driver (a threaded actor with a method that returns its argument), in the same run.

Run: .venv/bin/python benchmarks/terminal_latency.py [--samples 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import code_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="orch-bench-terminal-") as tmp:
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")
        os.environ.setdefault("ORCHESTRATOR_PYTHON", sys.executable)
        from orchestrator.cluster.local import LocalCluster, embedded_env

        cluster = LocalCluster()
        info = cluster.ensure_running()
        try:
            job = _push(Path(tmp))
            attach_s, echo, line = _terminal(job, args.samples)
            job.stop()
            os.environ.update(embedded_env())
            baseline = _bare_ray_client(info.client_address, args.samples)
        finally:
            cluster.stop()
    med = statistics.median
    print(f"code: {code_state()}; {args.samples} samples each; medians (min)")
    print(f"bare Ray Client actor call round trip: {med(baseline) * 1e3:.2f} ms "
          f"({min(baseline) * 1e3:.2f})")  # fmt: skip
    print(f"keystroke echo through the shell:      {med(echo) * 1e3:.2f} ms ({min(echo) * 1e3:.2f})"
          f" = {med(echo) / med(baseline):.2f}x the bare call")  # fmt: skip
    print(f"command round trip (echo + Enter):     {med(line) * 1e3:.2f} ms ({min(line) * 1e3:.2f})"
          f" = {med(line) / med(baseline):.2f}x the bare call")  # fmt: skip
    print(f"attach (CLI start to remote prompt):   {attach_s:.2f} s")


def _push(tmp: Path):
    from orchestrator.client.api import push

    job_dir = tmp / "job"
    job_dir.mkdir()
    (job_dir / "sleep.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(3600)\n")
    (job_dir / "config.py").write_text(
        textwrap.dedent("""
        from orchestrator import definitions as d
        project = d.TrainingProject(name="bench-terminal", job=d.TrainingJob(
            image=d.Image(base_image="python:3.11"), compute=d.Compute(memory="256Mi"),
            runtime=d.Runtime(start_commands=["python sleep.py"])))
    """)
    )
    job = push(job_dir / "config.py")
    deadline = time.monotonic() + 120
    while not any(line.endswith("] up") for line in job.logs()):
        if time.monotonic() > deadline:
            raise SystemExit("the job did not start")
        time.sleep(0.2)
    return job


def _terminal(job, samples: int) -> tuple[float, list[float], list[float]]:
    import pexpect

    started = time.perf_counter()
    term = pexpect.spawn(sys.executable, ["-m", "orchestrator", "shell", "--job-id", job.id],
                         dimensions=(40, 120), timeout=60)  # fmt: skip
    term.delaybeforesend = None  # pexpect's own 50 ms pause would swamp what is measured
    term.sendline("PS1='orch''> '")
    term.expect_exact("orch> ")
    attach_s = time.perf_counter() - started
    echo, line = [], []
    for i in range(samples):
        t = time.perf_counter()
        term.send("x")
        term.expect_exact("x")
        echo.append(time.perf_counter() - t)
        term.sendcontrol("u")  # clear the line again
        t = time.perf_counter()
        term.sendline(f"echo $((7*{i}+1))z")  # the echoed command line is not the output
        term.expect_exact(f"{7 * i + 1}z\r\n")
        line.append(time.perf_counter() - t)
        term.expect_exact("orch> ")
    term.sendline("exit")
    term.expect(pexpect.EOF)
    return attach_s, echo, line


def _bare_ray_client(address: str, samples: int) -> list[float]:
    import ray

    ray.init(address, logging_level="ERROR")

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Echo:
        def call(self, data: bytes) -> bytes:
            return data

    actor = Echo.remote()
    ray.get(actor.call.remote(b"warm"))
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        ray.get(actor.call.remote(b"x"))
        times.append(time.perf_counter() - t)
    ray.shutdown()
    return times


if __name__ == "__main__":
    main()
