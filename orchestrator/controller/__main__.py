"""`python -m orchestrator.controller --job-id ID --storage-root URL`: the entrypoint of a
controller that is a Ray job of its own (scheduler/launcher.py lists when one is)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import traceback

import ray

from orchestrator.agents.services import NAMESPACE
from orchestrator.scheduler import QUEUE_SERVICE_NAME


def reach_queue_service(storage_root: str, job_id: str) -> None:
    """A new driver's first call to an actor waits ~80 ms for the actor's address; made while
    the controller's modules import, the job's admission is then one call of ~2 ms. (None on a
    cluster's first job: the controller starts the service.) Then the controller host is
    started if it is not running, for the jobs the service admits after this one."""
    with contextlib.suppress(Exception):
        service = ray.get_actor(QUEUE_SERVICE_NAME, namespace=NAMESPACE)
        ray.get(service.admission.remote(storage_root, job_id), timeout=30)
    from orchestrator.controller.host import ensure_host

    try:
        ensure_host()
    except Exception:  # the service starts the next jobs as Ray jobs, which try again
        traceback.print_exc()


parser = argparse.ArgumentParser(prog="python -m orchestrator.controller")
parser.add_argument("--job-id", required=True)
parser.add_argument("--storage-root", required=True)
parser.add_argument("--scheduling-timeout", type=float, default=600.0)
args = parser.parse_args()
ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
threading.Thread(target=reach_queue_service, args=(args.storage_root, args.job_id),
                 daemon=True).start()  # fmt: skip

from orchestrator.controller.controller import run_controller  # noqa: E402 (after the thread)

sys.exit(run_controller(args.job_id, args.storage_root, args.scheduling_timeout))
