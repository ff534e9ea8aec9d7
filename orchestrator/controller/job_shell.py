"""`orchestrator shell -- CMD` on the cluster: one command in a running job's rank.

Runs as the entrypoint of a short Ray job, so a laptop needs only the Job API address: no SSH
keys and no open ports on the nodes. It finds the rank's node agent, which runs the command in
the job's working directory and environment (secrets resolved there, masked in the output);
prints the output after OUTPUT_MARKER and exits with the command's exit code.
"""

from __future__ import annotations

import argparse
import sys

import ray

from orchestrator.agents.node_agent import agent_name
from orchestrator.agents.services import NAMESPACE
from orchestrator.errors import last_line

OUTPUT_MARKER = "----- orchestrator shell output -----"
NOT_RUN_EXIT = 255  # the command never ran: why is on stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.controller.job_shell")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("command")
    args = parser.parse_args(argv)
    ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    try:
        agent = ray.get_actor(agent_name(args.job_id, args.rank), namespace=NAMESPACE)
    except ValueError:
        print(f"job {args.job_id} has no rank {args.rank} running on this cluster: it has "
              "ended, or its nodes are not prepared yet", file=sys.stderr)  # fmt: skip
        return NOT_RUN_EXIT
    try:
        result = ray.get(
            agent.exec_in_job.remote(args.command, args.timeout), timeout=args.timeout + 30
        )
    except Exception as e:
        print(f"could not run it on rank {args.rank}: {last_line(e)}",
              file=sys.stderr)  # fmt: skip
        return NOT_RUN_EXIT
    print(OUTPUT_MARKER, flush=True)
    sys.stdout.write(result.output)
    sys.stdout.flush()
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
