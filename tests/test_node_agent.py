"""The node agent's command runner, used directly in this process (no Ray)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from orchestrator.agents.messages import CommandsEnded, OutputLines
from orchestrator.agents.node_agent import NodeAgent
from orchestrator.agents.rank_program import CommandsProgram, StartRequest


def start(commands: list[str], cwd: Path | str, secrets=None, env=None) -> StartRequest:
    program = CommandsProgram(tuple(commands))
    return StartRequest(program, env or {}, secrets or {}, str(cwd), gpus_per_node=0)


def run(agent: NodeAgent, commands: list[str], cwd: Path, secrets=None, env=None):
    lines, result = [], None
    for item in agent.run_program(start(commands, cwd, secrets, env)):
        if isinstance(item, OutputLines):
            lines += item.lines
        else:
            result = item
    return lines, result


def gone(pid: int, timeout: float = 10) -> bool:
    """True once `pid` has exited (a zombie counts: it runs no more), within `timeout`: a
    SIGKILLed process is gone a moment after the signal."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def untagged(lines: list[str]) -> list[str]:
    return [line.split("] ", 1)[1] for line in lines]


def test_commands_run_in_order_and_stop_at_the_first_failure(tmp_path):
    agent = NodeAgent("j", 0, str(tmp_path / "storage"))
    lines, result = run(agent, ["echo one", "echo two >&2; exit 7", "echo three"], tmp_path)
    assert untagged(lines) == ["one", "two"]
    assert lines[0].startswith("[rank 0 ")
    assert result.exit_code == 7 and result.command == "echo two >&2; exit 7"
    assert result.last_lines == ["one", "two"]


def test_group_variables_for_a_group_of_one(tmp_path):
    agent = NodeAgent("j", 0, str(tmp_path / "storage"))
    lines, result = run(agent, ["echo $BT_GROUP_SIZE $NNODES $NODE_RANK $MASTER_PORT"], tmp_path)
    size, nnodes, rank, port = untagged(lines)[0].split()
    assert (size, nnodes, rank) == ("1", "1", "0") and int(port) > 0
    assert result.exit_code == 0


def test_secrets_are_resolved_masked_and_the_only_ones_visible(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_SECRET_HF_TOKEN", "hf_abcdef123456")
    monkeypatch.setenv("ORCHESTRATOR_SECRET_OTHER_TEAM", "not-yours-987654")
    agent = NodeAgent("j", 0, str(tmp_path / "storage"))
    lines, result = run(
        agent,
        ["echo token=$HF_TOKEN", "env | grep -c ORCHESTRATOR_SECRET_ || true"],
        tmp_path,
        secrets={"HF_TOKEN": "hf_token"},
    )
    assert untagged(lines) == ["token=*****", "0"]
    assert not any("hf_abcdef123456" in line for line in lines + result.last_lines)


def test_stop_reaches_every_process_of_the_command(tmp_path):
    agent = NodeAgent("j", 0, str(tmp_path / "storage"))
    script = "sleep 300 & echo child $!; sleep 300"
    stream = agent.run_program(start([script], tmp_path))
    item = next(stream)
    while not isinstance(item, OutputLines):
        item = next(stream)
    child = int(untagged(item.lines)[0].split()[1])
    assert psutil.pid_exists(child)
    assert agent.stop(grace_s=5)
    result = next(i for i in stream if isinstance(i, CommandsEnded))
    assert result.stopped and result.exit_code != 0
    assert gone(child, timeout=10), "a process of the command outlived stop"


AGENT_SCRIPT = """
import sys
from orchestrator.agents.node_agent import NodeAgent
from orchestrator.agents.rank_program import CommandsProgram, StartRequest
agent = NodeAgent("j", 0, sys.argv[1])
program = CommandsProgram(("sleep 300 & echo pid $!; wait",))
request = StartRequest(program, {}, {}, sys.argv[1], gpus_per_node=0)
for item in agent.run_program(request):
    print(getattr(item, "lines", item), flush=True)
"""


# What a Ray worker does as it exits (`ray.kill`, its owner gone): SIGKILL its direct children.
RAY_EXIT = """
import os, signal, psutil
for child in psutil.Process().children():
    os.kill(child.pid, signal.SIGKILL)
os._exit(1)
"""


def test_an_agent_whose_worker_ray_ends_leaves_no_orphan(tmp_path):
    """Ray SIGKILLs an exiting worker's direct children: the guard is one, so what the command
    started must end all the same, not be left running under init."""
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(AGENT_SCRIPT) + "    exec(sys.argv[2])\n")
    agent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), RAY_EXIT], stdout=subprocess.PIPE, text=True
    )
    try:
        first = agent.stdout.readline()
        pid = int(first.split("pid ")[1].split("'")[0])
        agent.wait(timeout=30)
        assert gone(pid, timeout=10), "the command outlived its agent's worker"
    finally:
        if agent.poll() is None:
            agent.kill()


def test_a_killed_agent_leaves_no_orphan(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(AGENT_SCRIPT))
    agent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        first = agent.stdout.readline()
        pid = int(first.split("pid ")[1].split("'")[0])
        assert psutil.pid_exists(pid)
        os.kill(agent.pid, signal.SIGKILL)  # the worker dies without a word
        agent.wait()
        assert gone(pid, timeout=10), "the command outlived its agent"
    finally:
        if agent.poll() is None:
            agent.kill()
