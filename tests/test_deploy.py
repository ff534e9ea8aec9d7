"""deploy_checkpoints end to end: the tiny-lora recipe trains on the embedded Ray, its checkpoints
are served by real Ray Serve applications, and the official `openai` client calls them.

The oracle is the same weights loaded here with transformers (and peft): greedy decoding is
deterministic, so the endpoint must give exactly what the checkpoint gives in-process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pexpect
import pytest
import yaml
from conftest import NODE_SECRET_NAME, NODE_SECRET_VALUE, eventually
from ray.serve.schema import ServeDeploySchema
from ray.util.state import list_actors, list_placement_groups
from recipe_serving import BROKEN_CONFIG, RECIPE, broken_checkpoints, greedy, trained_recipe

from orchestrator.client.api import push
from orchestrator.client.audit import events
from orchestrator.client.deploy import (
    DeployError,
    deploy_checkpoints,
    get_deployment,
    list_deployments,
    servable,
    stop_deployment,
)
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState
from orchestrator.spec.deploy import DeployCheckpointsConfig, DeployCheckpointsRuntime
from orchestrator.spec.secrets import SecretReference

PROMPT = "the dog"  # the full fine-tune and the adapter continue it differently


@pytest.fixture(scope="module")
def trained(ray_cluster, tmp_path_factory) -> Iterator[tuple[JobHandle, str, Path]]:
    """The recipe's job (checkpoint-0, checkpoint-30, its LoRA adapters), a Serve port of its
    own, and every deployment stopped at the end."""
    storage_root = str(tmp_path_factory.mktemp("deploy-storage"))
    local = tmp_path_factory.mktemp("deploy-checkpoints")
    with trained_recipe(storage_root, local) as job:
        yield job, storage_root, local


@pytest.fixture(scope="module")
def broken(trained, tmp_path_factory) -> tuple[JobHandle, Path]:
    """The job of checkpoints an engine cannot run (recipe_serving.py), in the same storage
    root, and its head_dim-16 GPT-2 downloaded here."""
    job = broken_checkpoints(trained[1], tmp_path_factory.mktemp("broken-job"))
    local = tmp_path_factory.mktemp("broken-checkpoints") / "headdim16"
    (gpt2,) = [m for m in job.checkpoints() if m.name == "headdim16-checkpoint-1"]
    job.download_checkpoint(gpt2, local)
    return job, local


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


def test_a_full_checkpoint_answers_as_its_weights_do(trained, ray_cluster):
    job, storage_root, local = trained
    secret = SecretReference(name=NODE_SECRET_NAME)
    config = DeployCheckpointsConfig(
        model_name="tiny-full",
        runtime=DeployCheckpointsRuntime(environment_variables={"HF_TOKEN": secret}),
    )
    start = time.monotonic()
    deployment = deploy_checkpoints(
        config, job_id=job.id, checkpoints=["checkpoint-30"], storage_root=storage_root
    )
    print(f"tiny-full (transformers) ready in {time.monotonic() - start:.1f} s")
    assert deployment.status == "RUNNING" and deployment.model_ids == ["tiny-full"]
    client = openai.OpenAI(base_url=deployment.url, api_key="unused", max_retries=0)

    done = client.completions.create(model="tiny-full", prompt=PROMPT, max_tokens=12,
                                     temperature=0)  # fmt: skip
    assert done.choices[0].text == greedy(local / "checkpoint-30", PROMPT, 12)
    assert done.usage is not None and done.usage.completion_tokens == 12

    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="tiny-full", messages=messages, max_tokens=10,
                                          temperature=0)  # fmt: skip
    text = chat.choices[0].message.content
    assert text, "the chat template rendered and the model answered"
    stream = client.chat.completions.create(model="tiny-full", messages=messages, max_tokens=10,
                                            temperature=0, stream=True)  # fmt: skip
    pieces = [c.choices[0].delta.content for c in stream if c.choices[0].delta.content]
    assert len(pieces) > 1, "a stream arrives in pieces"
    assert "".join(pieces) == text

    with pytest.raises(openai.NotFoundError, match="tiny-full"):
        client.completions.create(model="tiny-lora", prompt=PROMPT, max_tokens=2)

    # The secret was resolved on the serving node; the dashboard's Serve config names it only.
    shown = json.dumps(_serve_details(ray_cluster.dashboard_url))
    assert NODE_SECRET_NAME in shown and NODE_SECRET_VALUE not in shown


def test_lora_adapter_and_its_base_are_served_side_by_side(trained):
    job, storage_root, local = trained
    run = cli("deploy_checkpoints", "--job-id", job.id, "--checkpoint", "lora-checkpoint-30",
              "--non-interactive", "--storage-root", storage_root, "-o", "json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "engine: transformers" in run.stderr  # the choice and its reason are said
    deployment = json.loads(run.stdout)
    # The adapter's base is the job's own checkpoint-0 (a path on the training node, mapped
    # back to the stored checkpoint); the model is named after the project.
    assert deployment["model_ids"] == ["tiny-lora", "tiny-lora:lora-checkpoint-30"]
    client = openai.OpenAI(base_url=deployment["url"], api_key="unused", max_retries=0)

    def complete(model: str) -> str:
        done = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                         temperature=0)  # fmt: skip
        return done.choices[0].text

    base, adapted = complete("tiny-lora"), complete("tiny-lora:lora-checkpoint-30")
    assert base == greedy(local / "checkpoint-0", PROMPT, 12)
    assert adapted == greedy(local / "checkpoint-0", PROMPT, 12, local / "lora-checkpoint-30")
    assert adapted != base
    assert complete("tiny-lora") == base  # the adapter left nothing behind on the base


def test_deployments_are_listed_and_stopping_leaves_nothing(trained, ray_cluster):
    listed = cli("deployments", "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    by_name = {d["name"]: d for d in json.loads(listed.stdout)}
    assert set(by_name) == {"tiny-full", "tiny-lora"}
    job = trained[0]
    assert by_name["tiny-lora"]["checkpoints"] == [
        f"{job.id}/rank-0/checkpoint-0", f"{job.id}/rank-0/lora-checkpoint-30"
    ]  # fmt: skip
    assert all(d["status"] == "RUNNING" and d["replicas"] == 1 for d in by_name.values())

    # Their replicas downloaded the checkpoints to the node (truss's default download_folder).
    staged = Path("/tmp/training_checkpoints") / job.id / "rank-0"
    assert {p.name for p in staged.iterdir()} == {
        "checkpoint-30", "checkpoint-0", "lora-checkpoint-30"
    }  # fmt: skip
    stopped = cli("deployments", "stop", "tiny-full")
    assert stopped.returncode == 0, stopped.stderr
    assert [d.name for d in list_deployments()] == ["tiny-lora"]
    # Its copy left the node's disk with its replica; tiny-lora's are still loaded.
    eventually(lambda: {p.name for p in staged.iterdir()} == {"checkpoint-0", "lora-checkpoint-30"},
               "tiny-full's checkpoint removed from the node")  # fmt: skip
    stop_deployment("tiny-lora", storage_root=trained[1])  # the last one: Serve itself goes
    assert list_deployments() == []
    eventually(lambda: not staged.parent.exists(), "every downloaded checkpoint removed")
    # The audit trail: each deployment made, and each stop (the CLI's went to its default root).
    made = [(e.target, e.result, e.job) for e in events(storage_root=trained[1])
            if e.verb == "deploy"]  # fmt: skip
    assert ("tiny-full", "ok", job.id) in made and ("tiny-lora", "ok", job.id) in made
    stops = [e.target for e in events(storage_root=trained[1]) + events()
             if e.verb == "deployment stop" and e.result == "ok"]  # fmt: skip
    assert stops.count("tiny-full") == 1 and stops.count("tiny-lora") == 1
    alive = list_actors(address=ray_cluster.dashboard_url, filters=[("state", "=", "ALIVE")])
    serve_actors = [a.class_name for a in alive if "Serve" in a.class_name or "Proxy" in
                    a.class_name or "TransformersServer" in a.class_name]  # fmt: skip
    assert serve_actors == []
    placed = list_placement_groups(address=ray_cluster.dashboard_url, detail=True)
    assert [pg.name for pg in placed if pg.state == "CREATED" and
            not pg.name.startswith("orchestrator-")] == []  # fmt: skip


def test_a_secret_the_nodes_do_not_have_fails_the_deployment_naming_it(trained):
    """After the deployments above are stopped: each replica takes one of the cluster's CPUs."""
    job, storage_root, _ = trained
    config = DeployCheckpointsConfig(
        model_name="no-secret",
        runtime=DeployCheckpointsRuntime(
            environment_variables={"HF_TOKEN": SecretReference(name="never_set_anywhere")}
        ),
    )
    with pytest.raises(DeployError, match="never_set_anywhere"):
        deploy_checkpoints(config, job_id=job.id, checkpoints=["checkpoint-30"],
                           storage_root=storage_root, timeout=120)  # fmt: skip
    failed = [d for d in list_deployments() if d.name == "no-secret"]
    assert [d.status for d in failed] == ["DEPLOY_FAILED"]  # listed, with why, until stopped
    assert "never_set_anywhere" in failed[0].message
    stop_deployment("no-secret")


# The checkpoints of recipe_serving.BROKEN_WRITER the transformers engine cannot serve, each with
# the cause its deployment fails with: without the warm-up, heads-checkpoint-1 would be RUNNING,
# every request failing.
CANNOT_SERVE = {
    "noarch-checkpoint-1": (
        "could not load the model: ValueError: The checkpoint you are trying to load has "
        "model type `no-such-arch` but Transformers does not recognize"
    ),
    "mismatch-checkpoint-1": (
        "could not load the model: ValueError: The checkpoint's weights do not match its "
        "config.json: lm_head.weight is [400, 64] in the checkpoint, [400, 128] by config.json"
    ),
    "heads-checkpoint-1": (
        "failed its warm-up request (one token): RuntimeError: The size of tensor a (2) must "
        "match the size of tensor b (3)"
    ),
}


@pytest.mark.parametrize(("checkpoint", "cause"), CANNOT_SERVE.items(), ids=list(CANNOT_SERVE))
def test_a_model_that_cannot_load_or_run_fails_the_deployment_with_its_root_cause(
    trained, broken, checkpoint, cause
):
    """It fails the deploy, and stays listed, with its root cause in one line (for weights that
    do not fit their config.json, transformers' own error says only "look at the above report",
    a report printed to the replica's log)."""
    job, storage_root = broken[0], trained[1]
    name = checkpoint.removesuffix("-checkpoint-1")
    with pytest.raises(DeployError, match=re.escape(cause)) as raised:
        deploy_checkpoints(job_id=job.id, checkpoints=[checkpoint], model_name=name,
                           storage_root=storage_root, timeout=120)  # fmt: skip
    assert "\n" not in str(raised.value)
    failed = get_deployment(name)
    assert failed.status == "DEPLOY_FAILED" and cause in failed.cause, failed
    listed = cli("deployments", "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    (shown,) = [d for d in json.loads(listed.stdout) if d["name"] == name]
    assert cause in shown["cause"]
    table = cli("deployments", "list")
    assert f"{name} is DEPLOY_FAILED: " in table.stdout, table.stdout
    assert cause in " ".join(table.stdout.split()), table.stdout
    stop_deployment(name)


def test_a_model_vllms_cpu_build_cannot_run_is_ready_once_it_generated(trained, broken):
    """The GPT-2 of head_dim 16, which kills vLLM's CPU engine (tests/vllm_lane), is fine for
    transformers: RUNNING only after its warm-up token, then answering as its weights do."""
    (job, local), storage_root = broken, trained[1]
    start = time.monotonic()
    deployment = deploy_checkpoints(job_id=job.id, checkpoints=["headdim16-checkpoint-1"],
                                    model_name="hd16", storage_root=storage_root)  # fmt: skip
    print(f"hd16 (transformers) ready in {time.monotonic() - start:.1f} s")
    assert deployment.status == "RUNNING" and deployment.cause == ""
    client = openai.OpenAI(base_url=deployment.url, api_key="unused", max_retries=0)
    done = client.completions.create(model="hd16", prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.choices[0].text == greedy(local, PROMPT, 8)
    stop_deployment("hd16")


def test_dry_run_prints_a_serve_config_and_deploys_nothing(trained, tmp_path):
    job, storage_root, _ = trained
    several = cli("deploy_checkpoints", "--job-id", job.id, "--non-interactive", "--dry-run",
                  "--storage-root", storage_root)  # fmt: skip
    assert several.returncode == 2 and "--checkpoint" in several.stderr  # never a prompt

    run = cli("deploy_checkpoints", "--job-id", job.id, "--checkpoint", "lora-checkpoint-30",
              "--model-name", "dry", "--dry-run", "--storage-root", storage_root)  # fmt: skip
    assert run.returncode == 0, run.stderr
    config = ServeDeploySchema.model_validate(yaml.safe_load(run.stdout))
    (app,) = config.applications
    assert app.name == "dry" and app.route_prefix == "/dry"
    assert app.import_path == "orchestrator.serving.transformers_server:build_app"
    assert app.args["model"]["adapters"]["lora-checkpoint-30"]["job_id"] == job.id
    assert [d.name for d in list_deployments()] == []

    # A deploy config naming the checkpoint by job and name, as Baseten's do.
    deploy_py = tmp_path / "deploy.py"
    deploy_py.write_text(
        "from orchestrator.definitions import *\n"
        "deploy = DeployCheckpointsConfig(model_name='from-config', checkpoint_details="
        f"CheckpointList(checkpoints=[LoRACheckpoint(training_job_id='{job.id}', "
        "checkpoint_name='lora-checkpoint-30')]))\n"
    )
    run = cli("deploy_checkpoints", "--config", str(deploy_py), "--dry-run",
              "--storage-root", storage_root, "-o", "json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    (app,) = json.loads(run.stdout)["applications"]
    assert app["name"] == "from-config"
    assert app["args"]["model"]["base"]["checkpoint"]["name"] == "checkpoint-0"
    assert list(app["args"]["model"]["adapters"]) == ["lora-checkpoint-30"]


def test_the_wizard_lists_checkpoints_latest_first_and_asks_for_a_name(trained):
    job, storage_root, _ = trained
    wizard = pexpect.spawn(
        sys.executable, ["-m", "orchestrator", "deploy_checkpoints", "--job-id", job.id,
                         "--dry-run", "--storage-root", storage_root],
        env={**os.environ, "COLUMNS": "200"}, encoding="utf-8", timeout=60,
    )  # fmt: skip
    wizard.expect("Checkpoints to deploy")
    rows = [line.split("│") for line in wizard.before.splitlines() if line.count("│") > 3]
    listed = [row[2].strip() for row in rows if row[1].strip().isdigit()]
    newest_first = sorted(servable(job), key=lambda m: m.created_at, reverse=True)
    assert listed == [m.name for m in newest_first]
    wizard.sendline("lora-checkpoint-30")
    wizard.expect("Model name")
    wizard.expect(r"\(tiny-lora\)")  # the default: the base model's name
    wizard.sendline("wiz")
    wizard.expect(pexpect.EOF)
    wizard.close()
    assert wizard.exitstatus == 0, wizard.before
    assert "name: wiz" in wizard.before and "route_prefix: /wiz" in wizard.before


def _serve_details(dashboard_url: str) -> dict:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    return ServeSubmissionClient(dashboard_url).get_serve_details()


# `model.save_pretrained(os.environ["BT_CHECKPOINT_DIR"])`: config.json and model.safetensors at
# the top of the directory, which are the checkpoint `top-level` (issue 58).
SAVED_AT_THE_TOP = f"""
import os, sys
sys.path.insert(0, {str(RECIPE)!r})
import tiny_lm
tokenizer = tiny_lm.build_tokenizer()
tiny_lm.build_model(tokenizer, seed=3).save_pretrained(os.environ["BT_CHECKPOINT_DIR"])
tokenizer.save_pretrained(os.environ["BT_CHECKPOINT_DIR"])
"""


def test_a_model_saved_straight_into_the_checkpoint_directory_is_served(trained, tmp_path):
    storage_root = trained[1]
    (tmp_path / "write.py").write_text(SAVED_AT_THE_TOP)
    (tmp_path / "config.py").write_text(BROKEN_CONFIG.replace("broken-models", "saved-at-top"))
    job = push(tmp_path / "config.py", storage_root=storage_root)
    assert job.wait(timeout=300) == JobState.COMPLETED, job.logs()[-20:]
    assert not any("ignoring" in line for line in job.logs()), job.logs()[-20:]
    (top,) = job.checkpoints()
    assert (top.name, top.checkpoint_type, top.complete) == ("top-level", "full", True)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.path for f in top.files}
    local = job.download_checkpoint(top, tmp_path / "top-level")
    deployment = deploy_checkpoints(job_id=job.id, checkpoints=["top-level"], model_name="top",
                                    storage_root=storage_root)  # fmt: skip
    assert deployment.status == "RUNNING", deployment
    client = openai.OpenAI(base_url=deployment.url, api_key="unused", max_retries=0)
    done = client.completions.create(model="top", prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.choices[0].text == greedy(local, PROMPT, 8)
    stop_deployment("top", storage_root=storage_root)
