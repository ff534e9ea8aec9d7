"""`orchestrator stacks` on the cluster: every rank's Python stacks of a running job, now.

Runs as the entrypoint of a short Ray job, as `orchestrator shell` does (controller/job_shell.py):
a laptop needs only the Job API address. It asks every rank's node agent at once (py-spy on each
node, node/stacks.py), stores the set with the job as `stacks/taken-<time>/` (storage/stacks.py)
and prints the set's name after SET_MARKER.
"""

from __future__ import annotations

import argparse
import sys

import ray

from orchestrator.agents.node_agent import agent_name
from orchestrator.agents.services import NAMESPACE
from orchestrator.controller.ray_rank_group import gather_stacks
from orchestrator.errors import last_line
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stacks import StackStore, taken_name

SET_MARKER = "----- orchestrator stacks set -----"
NOT_TAKEN_EXIT = 255  # no rank answered: why is on stderr
WAIT_S = 10.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.controller.job_stacks")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--storage-root", required=True)
    args = parser.parse_args(argv)
    ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    asked = {}
    for rank in range(args.ranks):
        try:
            agent = ray.get_actor(agent_name(args.job_id, rank), namespace=NAMESPACE)
        except ValueError:
            continue
        asked[rank] = agent.stacks.remote()
    if not asked:
        print(f"job {args.job_id} has no rank running on this cluster: it has ended, or its "
              "nodes are not prepared yet", file=sys.stderr)  # fmt: skip
        return NOT_TAKEN_EXIT
    stacks = gather_stacks(asked, WAIT_S)
    name = taken_name()
    try:
        StackStore(StorageRoot(args.storage_root), args.job_id).store(name, stacks)
    except Exception as e:
        print(f"the stacks could not be stored: {last_line(e)}", file=sys.stderr)
        return NOT_TAKEN_EXIT
    print(SET_MARKER, flush=True)
    print(name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
