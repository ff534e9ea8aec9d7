"""Serving a checkpoint: deploy to first token, and what the endpoint adds to a request.

    .venv/bin/python benchmarks/serving.py [--deploys 3] [--requests 50] [--warmup 5]

On a private embedded Ray cluster (its own ORCHESTRATOR_HOME, storage root and Serve port,
stopped at the end) the tiny-lora recipe is pushed and trained (timed, but apart), then:

- deploy to first token: from calling `deploy_checkpoints(job_id=..., checkpoints=
  ["checkpoint-30"])` until the first content token of a streamed chat completion arrives
  through the endpoint (`openai` client), with the part until `deploy_checkpoints` returns.
  That is what a user waits for after training. Each run downloads into a fresh folder and is
  stopped afterwards; stopping the last application shuts Serve down, so every run starts Serve
  (controller, proxy) again. The first run is reported apart: it is the first on this cluster
  (nothing of Serve's imported or cached yet).
- request latency: a short greedy completion ("the dog", 16 tokens, temperature 0) through the
  endpoint, against the same call in-process on a `TransformersEngine` loaded from the same
  checkpoint, called as the server's handler calls it (`await engine.generate(...)`), without
  HTTP, Serve or Ray. Their ratio is what the serving path costs on top of generation (the
  target: under 1.3x). The same for a streamed chat completion's time to first content token
  against the engine's first piece of `engine.stream(...)`. The two ways alternate request by
  request, so drifting background load (Ray's own processes) hits both alike; both must give
  the same text.
- where an endpoint completion's time goes: each layer's own median for the same requests
  (matched by the x-request-id the benchmark sends): Serve's proxy and the replica, from their
  access logs; and engine.generate timed inside a plain Ray actor with the replica's
  num_cpus=1, which tells a slower engine in a Ray worker from the cost of Serve's path.

The Serve replica gets `num_cpus=1`, so Ray runs it with one torch thread (OMP_NUM_THREADS=1);
the in-process engine gets the same (`--threads`) unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import openai
from common import code_state, private_environment

from orchestrator.client.api import push
from orchestrator.client.deploy import Deployment, deploy_checkpoints, list_deployments
from orchestrator.client.jobs import JobHandle
from orchestrator.cluster.local import (
    LocalCluster,
    LocalClusterInfo,
)
from orchestrator.lifecycle import JobState
from orchestrator.serving.openai_api import ChatCompletionRequest, ChatMessage, CompletionRequest
from orchestrator.spec.deploy import CheckpointList, DeployCheckpointsConfig

COMMAND = ".venv/bin/python benchmarks/serving.py"
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-lora"
CHECKPOINT = "checkpoint-30"
MODEL = "bench-full"
PROMPT = "the dog"
MAX_TOKENS = 16
MESSAGES = [{"role": "user", "content": PROMPT}]
FIRST_TOKEN_TIMEOUT_S = 60.0  # after deploy_checkpoints returned, until the endpoint answers


@dataclass
class DeployRun:
    returned: float  # deploy_checkpoints() returned, seconds from its call
    first_token: float  # the first streamed content token arrived, seconds from the same call
    refused: int  # requests refused before the endpoint answered (route not known yet)


@dataclass
class Paired:
    """Seconds per request through the endpoint and in-process, and the texts each gave."""

    endpoint: list[float] = field(default_factory=list)
    in_process: list[float] = field(default_factory=list)
    texts: set[tuple[str, str]] = field(default_factory=set)  # (endpoint's, in-process's)


# -- The cluster and the trained job -------------------------------------------------------


def train(storage_root: str, local: Path) -> tuple[JobHandle, float]:
    """Push the recipe, wait for COMPLETED, download checkpoint-30 into `local`."""
    started = time.perf_counter()
    job = push(RECIPE / "config.py", storage_root=storage_root)
    state = job.wait(timeout=600)
    took = time.perf_counter() - started
    if state != JobState.COMPLETED:
        raise RuntimeError(f"the recipe's job ended {state.value}:\n" + "\n".join(job.logs()[-20:]))
    job.download_checkpoint(job.checkpoint(CHECKPOINT), local)
    return job, took


# -- Deploy to first token -----------------------------------------------------------------


def deploy(job: JobHandle, storage_root: str, download_folder: Path) -> Deployment:
    """`deploy_checkpoints` of checkpoint-30; the replica downloads into `download_folder`."""
    config = DeployCheckpointsConfig(
        checkpoint_details=CheckpointList(download_folder=str(download_folder))
    )
    return deploy_checkpoints(
        config, job_id=job.id, checkpoints=[CHECKPOINT], model_name=MODEL,
        storage_root=storage_root,
    )  # fmt: skip


def client_for(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.url, api_key="unused", max_retries=0)


def stream_chat(client: openai.OpenAI) -> tuple[float, str]:
    """A streamed greedy chat completion, read to its end: when (perf_counter) its first content
    token arrived, and the whole text."""
    first, pieces = None, []
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )  # type: ignore[call-overload]
    for chunk in stream:
        if chunk.choices and (content := chunk.choices[0].delta.content):
            first = first or time.perf_counter()
            pieces.append(content)
    if first is None:
        raise RuntimeError("the stream had no content")
    return first, "".join(pieces)


def deploy_to_first_token(job: JobHandle, storage_root: str, download_folder: Path) -> DeployRun:
    """One deployment, from the call to its first token; stopped before this returns."""
    started = time.perf_counter()
    deployment = deploy(job, storage_root, download_folder)
    returned = time.perf_counter() - started
    client, refused = client_for(deployment), 0
    deadline = time.monotonic() + FIRST_TOKEN_TIMEOUT_S
    try:
        while True:
            try:
                first, _ = stream_chat(client)
                return DeployRun(returned, first - started, refused)
            except (openai.APIStatusError, openai.APIConnectionError):
                refused += 1
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
    finally:
        client.close()
        deployment.stop()


# -- Request latency: the endpoint against the engine in-process ---------------------------


class InProcess:
    """The server's engine, loaded here, called the way the OpenAI handlers call it."""

    def __init__(self, model_dir: Path) -> None:
        from transformers.utils import logging as hf_logging

        from orchestrator.serving.transformers_engine import TransformersEngine  # torch: slow

        hf_logging.disable_progress_bar()  # "Loading weights" bars
        self.engine = TransformersEngine(MODEL, model_dir)
        self.loop = asyncio.new_event_loop()
        # The handlers' own request models give the sampling parameters they would pass.
        completion = CompletionRequest(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        self.completion_params = completion.sampling(completion.max_tokens)
        chat = ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
        )
        self.chat_params = chat.sampling(chat.max_completion_tokens or chat.max_tokens)

    def complete(self) -> str:
        """`await engine.generate(model, prompt, params)`, as `openai_api.completions` does."""
        coro = self.engine.generate(MODEL, PROMPT, self.completion_params)
        return self.loop.run_until_complete(coro).text

    def stream_chat(self) -> tuple[float, str]:
        """`engine.chat_prompt` then `engine.stream`, as `openai_api.chat_completions` does:
        when its first piece with text came, and the whole text."""

        async def run() -> tuple[float, str]:
            prompt = self.engine.chat_prompt(MODEL, [ChatMessage(**m) for m in MESSAGES])
            first, pieces = None, []
            async for piece in self.engine.stream(MODEL, prompt, self.chat_params):
                if piece.text:
                    first = first or time.perf_counter()
                    pieces.append(piece.text)
            if first is None:
                raise RuntimeError("the engine's stream had no text")
            return first, "".join(pieces)

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.loop.close()


Call = Callable[[], tuple[float, str]]  # one request: the moment (perf_counter) measured, text


def paired(endpoint: Call, in_process: Call, count: int, warmup: int) -> Paired:
    """Seconds from each call to the moment it reports, the two ways alternating (and which
    goes first alternating too)."""
    for _ in range(warmup):
        endpoint(), in_process()
    result = Paired()
    for i in range(count):
        order = [(endpoint, result.endpoint), (in_process, result.in_process)]
        texts = {}
        for call, seconds in order if i % 2 == 0 else reversed(order):
            started = time.perf_counter()
            moment, texts[call] = call()
            seconds.append(moment - started)
        result.texts.add((texts[endpoint], texts[in_process]))
    return result


def finished(call: Callable[[], str]) -> Call:
    """A whole request: measured until it returns."""

    def timed() -> tuple[float, str]:
        text = call()
        return time.perf_counter(), text

    return timed


@dataclass
class Breakdown:
    """Where one endpoint completion's time goes, median milliseconds of each layer's own
    measure of the same requests (matched by their x-request-id)."""

    proxy: float | None  # Serve's HTTP proxy: request in to response out (its access log)
    replica: float | None  # the replica: its FastAPI handler, engine included (its access log)
    actor_inside: float  # engine.generate timed inside a plain Ray actor with num_cpus=1
    actor_call: float  # the same, as the driver sees it: one Ray actor call around it


def measure_latency(
    job: JobHandle,
    storage_root: str,
    local: Path,
    work: Path,
    info: LocalClusterInfo,
    args: argparse.Namespace,
) -> tuple[Paired, Paired, Breakdown]:
    import torch

    torch.set_num_threads(args.threads)
    deployment = deploy(job, storage_root, work / "download-latency")
    client = client_for(deployment)
    engine = InProcess(local)
    request_ids: list[str] = []
    try:

        def endpoint_complete() -> str:
            request_ids.append(f"bench-{uuid.uuid4().hex}")  # Serve logs it as its own id
            done = client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                extra_headers={"x-request-id": request_ids[-1]},
            )  # fmt: skip
            return done.choices[0].text

        complete = paired(
            finished(endpoint_complete), finished(engine.complete), args.requests, args.warmup
        )
        first_token = paired(
            lambda: stream_chat(client), engine.stream_chat, args.requests, args.warmup
        )
    finally:
        engine.close()
        client.close()
        deployment.stop()
    measured = request_ids[-args.requests :]
    logs = Path(info.temp_dir or "") / "session_latest" / "logs" / "serve"
    proxy, replica = access_log(logs, "proxy_*.log"), access_log(logs, "replica_*.log")
    inside, call = engine_in_ray_actor(info, local, args)
    breakdown = Breakdown(
        proxy=_median_of(proxy, measured),
        replica=_median_of(replica, measured),
        actor_inside=statistics.median(inside) * 1000,
        actor_call=statistics.median(call) * 1000,
    )
    return complete, first_token, breakdown


_ACCESS = re.compile(r" (\S+) -- POST /\S+/v1/completions 200 ([0-9.]+)ms$")


def _median_of(logged: dict[str, float], ids: list[str]) -> float | None:
    """The median over the requests a log has (None if it has none: Serve may buffer or
    disable its access log, or run without a proxy)."""
    found = [logged[i] for i in ids if i in logged]
    return statistics.median(found) if found else None


def access_log(folder: Path, pattern: str) -> dict[str, float]:
    """Milliseconds of each completion request by id, from Serve's access logs."""
    found = {}
    for log in folder.glob(pattern):
        for line in log.read_text(errors="replace").splitlines():
            if match := _ACCESS.search(line):
                found[match[1]] = float(match[2])
    return found


def engine_in_ray_actor(
    info: LocalClusterInfo, model_dir: Path, args: argparse.Namespace
) -> tuple[list[float], list[float]]:
    """engine.generate in a plain Ray actor with the replica's num_cpus=1 (so Ray's torch
    thread count too), on the same node: seconds inside it, and around its Ray call."""
    import ray

    @ray.remote(num_cpus=1)
    class EngineActor:
        def __init__(self, model_dir: str) -> None:
            self.engine = InProcess(Path(model_dir))

        def complete(self) -> float:
            started = time.perf_counter()
            self.engine.complete()
            return time.perf_counter() - started

    ray.init(address=info.gcs_address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        actor = EngineActor.remote(str(model_dir))  # type: ignore[attr-defined]
        for _ in range(args.warmup):
            ray.get(actor.complete.remote())
        inside, around = [], []
        for _ in range(args.requests):
            started = time.perf_counter()
            inside.append(ray.get(actor.complete.remote()))
            around.append(time.perf_counter() - started)
        ray.kill(actor)
        return inside, around
    finally:
        ray.shutdown()


# -- Report ---------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} / {p90(values) * 1000:.1f} ms"


def report_pair(title: str, p: Paired) -> list[tuple[str, str]]:
    """Print one comparison; return its rows for the summary."""
    e, i = statistics.median(p.endpoint), statistics.median(p.in_process)
    print(f"\n{title} ({len(p.endpoint)} each)")
    print(f"  endpoint (openai client)  median {ms(e)}   p90 {ms(p90(p.endpoint))}")
    print(f"  in-process engine         median {ms(i)}   p90 {ms(p90(p.in_process))}")
    print(f"  ratio of medians {e / i:.2f}x (the endpoint adds {ms(e - i).strip()})")
    for endpoint_text, engine_text in sorted(p.texts):
        same = "same text" if endpoint_text == engine_text else "DIFFERENT TEXTS"
        print(f"  {same}: endpoint {endpoint_text!r}, in-process {engine_text!r}")
    return [
        (f"{title}: endpoint median / p90", _spread(p.endpoint)),
        (f"{title}: in-process median / p90", _spread(p.in_process)),
        (f"{title}: ratio of medians", f"{e / i:.2f}x"),
    ]


def report_breakdown(complete: Paired, b: Breakdown) -> list[tuple[str, str]]:
    """Each layer's median, outermost first, and what it adds over the one inside it."""
    endpoint, in_process = (statistics.median(v) * 1000 for v in (complete.endpoint,
                                                                  complete.in_process))  # fmt: skip
    layers = [
        ("the client sees (openai client, HTTP)", endpoint),
        ("Serve's proxy logs (HTTP in -> response out)", b.proxy),
        ("the replica logs (its handler, engine included)", b.replica),
        ("engine.generate inside a Ray actor, num_cpus=1", b.actor_inside),
        ("engine.generate in-process (this process)", in_process),
    ]  # fmt: skip
    present = [(what, value) for what, value in layers if value is not None]
    print("\nwhere an endpoint completion's time goes (medians of each layer's own measure)")
    for n, (what, value) in enumerate(present):
        inner = present[n + 1][1] if n + 1 < len(present) else None
        added = "" if inner is None else f"  ({value - inner:+5.1f} ms over the next)"
        print(f"  {what:<50} {value:6.1f} ms{added}")
    for what, value in layers:
        if value is None:
            print(f"  {what:<50}    n/a (no access log lines for these requests)")
    print(f"  {'one Ray actor call around that generate':<50} {b.actor_call:6.1f} ms  "
          f"({b.actor_call - b.actor_inside:+5.1f} ms: a bare Ray call's cost)")  # fmt: skip

    def shown(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    layers_row = f"{shown(b.proxy)} / {shown(b.replica)} / {b.actor_inside:.1f} ms"
    return [("completion: proxy / replica / engine in a Ray actor", layers_row)]


def report_deploys(runs: list[DeployRun]) -> list[tuple[str, str]]:
    print("\ndeploy to first token (deploy_checkpoints call -> first streamed content token)")
    for n, r in enumerate(runs, 1):
        print(f"  run {n}: {r.first_token:6.2f} s  (deploy_checkpoints returned at "
              f"{r.returned:5.2f} s; {r.refused} requests refused before it answered)")  # fmt: skip
    first, rest = runs[0], runs[1:]
    rows = [
        ("deploy to first token, run 1 (starts Serve)", f"{first.first_token:6.2f} s"),
        ("  of which deploy_checkpoints returned", f"{first.returned:6.2f} s"),
    ]
    if rest:
        token = statistics.median(r.first_token for r in rest)
        returned = statistics.median(r.returned for r in rest)
        rows += [
            (f"deploy to first token, runs 2-{len(runs)} (median)", f"{token:6.2f} s"),
            ("  of which deploy_checkpoints returned", f"{returned:6.2f} s"),
        ]
    return rows


def print_summary(rows: list[tuple[str, str]]) -> None:
    width = max(len(what) for what, _ in rows)
    print("\nsummary")
    for what, value in rows:
        print(f"  {what:<{width}}  {value}")
    print(f"\nrun with: {COMMAND} {' '.join(sys.argv[1:])}".rstrip())


# -- Main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deploys", type=int, default=3, help="deploy-to-first-token runs")
    parser.add_argument("--requests", type=int, default=50, help="measured requests each way")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured requests each way first")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads in-process (the replica has 1)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    private_environment(work)
    cluster = LocalCluster(state_dir=work / "home" / "local-cluster")
    print(f"code {code_state()}; cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    info = None
    try:
        started = time.perf_counter()
        info = cluster.start()
        print(f"local cluster {info.dashboard_url} up in {time.perf_counter() - started:.1f} s; "
              f"Serve port {os.environ['ORCHESTRATOR_SERVE_PORT']}")  # fmt: skip
        storage_root, local = str(work / "storage"), work / "local" / CHECKPOINT
        job, trained = train(storage_root, local)
        print(f"push tiny-lora -> COMPLETED in {trained:.1f} s (job {job.id}; not part of the "
              "serving figures)")  # fmt: skip
        runs = [
            deploy_to_first_token(job, storage_root, work / f"download-{n}")
            for n in range(args.deploys)
        ]
        rows = [("push tiny-lora -> COMPLETED (apart)", f"{trained:6.1f} s")]
        rows += report_deploys(runs)
        complete, first_token, breakdown = measure_latency(
            job, storage_root, local, work, info, args
        )
        rows += report_pair(f"completion, {MAX_TOKENS} tokens greedy", complete)
        rows += report_breakdown(complete, breakdown)
        rows += report_pair("streamed chat, time to first token", first_token)
        print_summary(rows)
    finally:
        _stop(cluster, info is not None)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if info is not None and info.temp_dir:
                shutil.rmtree(info.temp_dir, ignore_errors=True)
    return 0


def _stop(cluster: LocalCluster, started: bool) -> None:
    """Any deployment left (a failed run), then the cluster."""
    if not started:
        return
    try:
        for d in list_deployments():
            d.stop()
    except Exception as e:  # the cluster goes anyway
        print(f"could not stop the deployments: {e}", file=sys.stderr)
    cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
