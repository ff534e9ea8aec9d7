#!/usr/bin/env bash
# The Ray floor lane: the oldest Ray orchestrator supports (the floor of pyproject.toml's range),
# in a virtualenv of its own, .venv-rayfloor, made once and reused; run after the main suite
# (the README's test command), which runs on the newest. A smoke of what a job needs from Ray:
# the mnist recipe COMPLETED, a 2-node gang on a simulated cluster, a checkpoint uploaded and
# loaded by a second job, a queued job admitted after another, stop; and the private calls and
# `doctor` on this Ray.
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(python3 -c 'import re,sys; s=open("pyproject.toml").read(); print(re.search(r"\"ray\[default,train,serve\]>=([0-9.]+),", s).group(1))')
venv=.venv-rayfloor
if [ ! -x "$venv/bin/python" ] \
    || [ "$("$venv/bin/python" -c 'import ray; print(ray.__version__)' 2>/dev/null)" != "$floor" ] \
    || ! "$venv/bin/python" -c "import orchestrator" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -e '.[dev]' "ray[default,train,serve]==$floor"
fi
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@" \
    tests/test_ray_versions.py \
    tests/test_doctor.py \
    "tests/test_submit_paths.py::test_cli_push_tail_runs_the_mnist_recipe_to_completed" \
    "tests/test_multinode.py::test_ranks_on_distinct_nodes_with_the_env_contract" \
    "tests/test_checkpoints_e2e.py::test_a_later_job_loads_the_latest_checkpoint_of_a_project" \
    "tests/test_jobs.py::test_stop_ends_the_processes_and_removes_the_placement_group"
