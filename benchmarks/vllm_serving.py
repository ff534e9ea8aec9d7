"""The vllm engine on CPU: deploy to first token, and time to first token and tokens/s through the
endpoint against offline vLLM on the same checkpoint, in the same run.

    .venv-vllm/bin/python benchmarks/vllm_serving.py [--runs 5] [--tokens 64]

Needs the vLLM lane's virtualenv (tests/vllm-lane.sh makes `.venv-vllm`). On a private embedded
Ray cluster (its own ORCHESTRATOR_HOME, storage root and Serve port; stopped at the end) the
tiny-lora recipe is trained, then:

1. baseline: offline vLLM (`vllm.LLM`, a subprocess, as vLLM's engine starts processes of its
   own) on the stored checkpoint-30, with the engine settings the deployment uses (float32,
   eager): engine start, time to first token (a 1-token greedy generation) and decode tokens/s
   (`--tokens` greedy tokens, end of text ignored), medians of `--runs`;
2. `deploy_checkpoints(..., engine="vllm")` of the same checkpoint: from the call until it
   returns (Ray Serve LLM reports the application running), and until the first token of a
   streamed completion arrives through the endpoint (`openai` client);
3. through the endpoint: the same time to first token (streamed) and tokens/s, medians of
   `--runs`, and their ratios against the baseline: what Ray Serve LLM, HTTP and Serve add.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import openai
from common import code_state, private_environment

from orchestrator.client.api import push
from orchestrator.client.deploy import deploy_checkpoints, list_deployments
from orchestrator.cluster.local import LocalCluster
from orchestrator.lifecycle import JobState

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-lora"
CHECKPOINT = "checkpoint-30"
PROMPT = "the dog"

OFFLINE = """
import json, statistics, sys, time
if __name__ == "__main__":
    model, runs, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=256)
    start_s = time.perf_counter() - started
    first, decode = [], []
    for _ in range(runs + 1):  # the first of each is a warm-up
        t = time.perf_counter()
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        first.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=tokens,
                                                     ignore_eos=True), use_tqdm=False)
        decode.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - t))
    print("OFFLINE " + json.dumps({"start_s": start_s, "first_s": statistics.median(first[1:]),
                                   "tokens_per_s": statistics.median(decode[1:])}), flush=True)
"""


def offline(model_dir: Path, runs: int, tokens: int) -> dict[str, float]:
    script = textwrap.dedent(OFFLINE).replace("PROMPT", repr(PROMPT))
    run = subprocess.run(
        [sys.executable, "-c", script, str(model_dir), str(runs), str(tokens)],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    line = next((x for x in run.stdout.splitlines() if x.startswith("OFFLINE ")), None)
    if line is None:
        raise RuntimeError(f"offline vLLM failed:\n{run.stderr[-3000:]}")
    return json.loads(line.removeprefix("OFFLINE "))


def first_token(client: openai.OpenAI, model: str) -> float:
    """Seconds until the first token of a streamed greedy completion arrives."""
    started = time.perf_counter()
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                       stream=True)  # fmt: skip
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream had no text")
    return first


def tokens_per_s(client: openai.OpenAI, model: str, tokens: int) -> float:
    started = time.perf_counter()
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert done.usage is not None
    return done.usage.completion_tokens / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="measured requests of each kind")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the tokens/s requests")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    private_environment(work)
    cluster = LocalCluster(state_dir=work / "home" / "local-cluster")
    print(f"code {code_state()}; cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    info = None
    try:
        info = cluster.start()
        storage_root, local = str(work / "storage"), work / "local"
        job = push(RECIPE / "config.py", storage_root=storage_root)
        if job.wait(timeout=600) != JobState.COMPLETED:
            raise RuntimeError("the recipe's job failed:\n" + "\n".join(job.logs()[-20:]))
        job.download_checkpoint(job.checkpoint(CHECKPOINT), local)

        base = offline(local, args.runs, args.tokens)
        started = time.perf_counter()
        deployment = deploy_checkpoints(job_id=job.id, checkpoints=[CHECKPOINT], engine="vllm",
                                        storage_root=storage_root, timeout=900)  # fmt: skip
        returned = time.perf_counter() - started
        client = openai.OpenAI(base_url=deployment.url, api_key="unused", max_retries=0)
        model = deployment.model_ids[0]
        to_first = time.perf_counter() - started + first_token(client, model)
        first_token(client, model)  # warm-up
        firsts = [first_token(client, model) for _ in range(args.runs)]
        tokens_per_s(client, model, args.tokens)  # warm-up
        rates = [tokens_per_s(client, model, args.tokens) for _ in range(args.runs)]
        deployment.stop()

        first, rate = statistics.median(firsts), statistics.median(rates)
        rows = [
            ("offline vLLM: engine start", f"{base['start_s']:.1f} s"),
            ("deploy_checkpoints(engine='vllm') returned", f"{returned:.1f} s"),
            ("deploy -> first token through the endpoint", f"{to_first:.1f} s"),
            ("time to first token: offline vLLM", f"{base['first_s'] * 1000:.1f} ms"),
            ("time to first token: endpoint (streamed)",
             f"{first * 1000:.1f} ms ({first / base['first_s']:.2f}x, "
             f"+{(first - base['first_s']) * 1000:.1f} ms)"),
            (f"tokens/s, {args.tokens} greedy: offline vLLM", f"{base['tokens_per_s']:.1f}"),
            (f"tokens/s, {args.tokens} greedy: endpoint",
             f"{rate:.1f} ({rate / base['tokens_per_s']:.2f}x)"),
        ]  # fmt: skip
        width = max(len(name) for name, _ in rows)
        print()
        for name, value in rows:
            print(f"{name:<{width}}  {value}")
        print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    finally:
        if info is not None:
            for d in list_deployments():
                d.stop()
            cluster.stop()
            if info.temp_dir:  # Ray's session files
                shutil.rmtree(info.temp_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
