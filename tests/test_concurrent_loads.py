"""Configs loaded and pushed from many threads at once, as a sweep from a thread pool does.

Baseten's import paths (`truss_train`, `truss.base`) are stand-ins installed while a config
loads; a load that ends must never take them from one still running.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import make_job

from orchestrator.client.api import push
from orchestrator.client.config_loader import load_config
from orchestrator.client.truss_compat import baseten_imports, truss_installed
from orchestrator.lifecycle import JobState

THREADS, LOADS = 8, 50

BASETEN_CONFIG = """
from truss_train import definitions
from truss.base import truss_config
{sibling}
project = definitions.TrainingProject(
    name={name},
    job=definitions.TrainingJob(
        image=definitions.Image(base_image="python:3.11"),
        compute=definitions.Compute(
            accelerator=truss_config.AcceleratorSpec(accelerator="H100", count=1),
        ),
    ),
)
"""


def load_from_threads(configs: list[Path], names: list[str]) -> list[str]:
    """Each thread loads its config LOADS times, all threads at once; what went wrong."""
    start = threading.Barrier(len(configs))

    def load_many(t: int) -> list[str]:
        start.wait()
        failures = []
        for _ in range(LOADS):
            try:
                name = load_config(configs[t]).project.name
            except Exception as e:
                failures.append(f"{type(e).__name__}: {e}")
            else:
                if name != names[t]:
                    failures.append(f"config {t} loaded as {name!r}")
        return failures

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often: a race shows in a few hundred loads
    try:
        with ThreadPoolExecutor(len(configs)) as pool:
            return [f for found in pool.map(load_many, range(len(configs))) for f in found]
    finally:
        sys.setswitchinterval(switch)


def test_baseten_configs_load_from_many_threads_at_once(tmp_path: Path) -> None:
    names = [f"sweep-{t}" for t in range(THREADS)]
    configs = [
        make_job(tmp_path / f"c{t}", BASETEN_CONFIG.format(sibling="", name=repr(name)))
        for t, name in enumerate(names)
    ]
    real_exit = os._exit

    failures = load_from_threads(configs, names)

    assert failures == [], f"{len(failures)} of {THREADS * LOADS} loads failed: {failures[:3]}"
    assert os._exit is real_exit, "a load restored another load's refusing os._exit"
    assert not {"truss", "truss_train"} & set(sys.modules)


def test_configs_loading_at_once_each_import_their_own_sibling(tmp_path: Path) -> None:
    """Every config's directory holds a `helper.py`: a load that imports another's shows as a
    wrong name."""
    names = [f"team-{t}" for t in range(THREADS)]
    configs = [
        make_job(tmp_path / f"c{t}", BASETEN_CONFIG.format(sibling="import helper",
                                                           name="helper.NAME"),
                 {"helper.py": f"NAME = {name!r}\n"})
        for t, name in enumerate(names)
    ]  # fmt: skip

    failures = load_from_threads(configs, names)

    assert failures == [], f"{len(failures)} of {THREADS * LOADS} loads failed: {failures[:3]}"
    assert "helper" not in sys.modules


@pytest.mark.skipif(truss_installed(), reason="the stand-ins are used only without truss")
def test_the_stand_ins_stay_while_any_load_runs() -> None:
    """A load that started first and ends first leaves them to the one still running."""
    entered, leave, left = threading.Event(), threading.Event(), threading.Event()

    def earlier_load() -> None:
        with baseten_imports():
            entered.set()
            leave.wait(10)
        left.set()

    thread = threading.Thread(target=earlier_load)
    thread.start()
    assert entered.wait(10)
    with baseten_imports():
        leave.set()
        assert left.wait(10)
        from truss_train import definitions

        assert definitions.TrainingProject.__module__.startswith("orchestrator")
    thread.join()
    assert not {"truss", "truss_train"} & set(sys.modules)


CPU_JOB = """
from truss_train import definitions as d
from truss.base import truss_config
project = d.TrainingProject(
    name={project!r},
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="256Mi"),
        runtime=d.Runtime(start_commands=["echo sweep point {point}"]),
    ),
)
"""


@pytest.mark.usefixtures("ray_cluster")
def test_pushes_from_a_thread_pool_all_complete(tmp_path: Path, storage_root: str) -> None:
    """Six pushes of one project at once: a notebook's sweep. Each is submitted, runs, and
    the project gets one id."""
    pushes = 6
    configs = [
        make_job(tmp_path / f"p{i}", CPU_JOB.format(project="thread-sweep", point=i))
        for i in range(pushes)
    ]
    start = threading.Barrier(pushes)

    def push_one(config: Path):
        start.wait()
        return push(config, storage_root=storage_root)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # as in load_from_threads: the pushes' loads interleave
    try:
        with ThreadPoolExecutor(pushes) as pool:
            jobs = list(pool.map(push_one, configs))
    finally:
        sys.setswitchinterval(switch)

    for i, job in enumerate(jobs):
        assert job.wait(timeout=180) == JobState.COMPLETED, job.logs()
        assert any(line.endswith(f"sweep point {i}") for line in job.logs())
    assert len({job.project_id for job in jobs}) == 1
