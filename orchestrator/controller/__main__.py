"""`python -m orchestrator.controller --job-id ID --storage-root URL`: a job's Ray entrypoint."""

from __future__ import annotations

import argparse
import sys

from orchestrator.controller.controller import run_controller

parser = argparse.ArgumentParser(prog="python -m orchestrator.controller")
parser.add_argument("--job-id", required=True)
parser.add_argument("--storage-root", required=True)
parser.add_argument("--scheduling-timeout", type=float, default=600.0)
args = parser.parse_args()
sys.exit(run_controller(args.job_id, args.storage_root, args.scheduling_timeout))
