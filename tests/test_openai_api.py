"""The OpenAI-compatible API over the transformers engine, called with the official `openai` client.

No Ray: the app is wired the way the Serve deployment wires it (a class whose methods call the
handlers) and served in-process through starlette's TestClient. The model is the tiny Llama of
the tiny-lora recipe plus a LoRA adapter with random weights, so base and adapter differ.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from fastapi import FastAPI
from peft import LoraConfig, PeftModel, get_peft_model
from starlette.requests import Request
from starlette.responses import Response
from starlette.testclient import TestClient
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from orchestrator.serving.openai_api import (
    CompletionRequest,
    ModelNotFoundError,
    chat_completions,
    completions,
    install_error_handlers,
    list_models,
)
from orchestrator.serving.transformers_engine import TransformersEngine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes" / "tiny-lora"))
import tiny_lm  # noqa: E402

BASE, ADAPTER, ADAPTER_2 = "tiny-lm", "tiny-lm:lora-checkpoint-30", "tiny-lm:lora-checkpoint-60"
PROMPT = "The cat sat on the"


class Server:
    """Stands in for the Ray Serve deployment: one engine, each route a one-line method."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine

    async def models(self) -> Response:
        return await list_models(self.engine)

    async def completions(self, request: Request) -> Response:
        return await completions(self.engine, request)

    async def chat(self, request: Request) -> Response:
        return await chat_completions(self.engine, request)


def build_app(engine: TransformersEngine) -> FastAPI:
    server, api = Server(engine), FastAPI()
    install_error_handlers(api)
    api.add_api_route("/v1/models", server.models, methods=["GET"])
    api.add_api_route("/v1/completions", server.completions, methods=["POST"])
    api.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    return api


@dataclass
class Served:
    client: openai.OpenAI
    http: TestClient
    references: dict[str, torch.nn.Module]  # each served id loaded directly, to compare with


def openai_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
    )


def save_random_lora(base_dir: Path, out: Path, seed: int) -> None:
    """A LoRA adapter that changes the model: peft starts lora_B at zero, so it is randomised."""
    lora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    torch.manual_seed(seed)
    for name, param in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    lora.save_pretrained(out)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served")
    base_dir = root / "base"
    tiny_lm.build_model(tokenizer(), seed=0).save_pretrained(base_dir)
    tokenizer().save_pretrained(base_dir)
    adapters = {ADAPTER: root / "adapter", ADAPTER_2: root / "adapter-2"}
    for seed, directory in enumerate(adapters.values(), start=1):
        save_random_lora(base_dir, directory, seed)
    # A tokenizer saved beside an adapter, without a chat template: the engine must ignore it.
    plain = tiny_lm.build_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(adapters[ADAPTER])

    references: dict[str, torch.nn.Module] = {BASE: AutoModelForCausalLM.from_pretrained(base_dir)}
    for model_id, directory in adapters.items():
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        references[model_id] = PeftModel.from_pretrained(base, directory)
    engine = TransformersEngine(BASE, base_dir, adapters=adapters)
    with TestClient(build_app(engine)) as http:
        yield Served(openai_client(http), http, {k: m.eval() for k, m in references.items()})


def greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """What `transformers` itself generates greedily: the tokens after the prompt."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens
        )
    return out[0, len(prompt_ids) :].tolist()


@functools.cache
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_lm.build_tokenizer()


def decode(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def prompt_ids(text: str) -> list[int]:
    return tokenizer()(text)["input_ids"]


def test_models_lists_the_base_then_each_adapter(served: Served) -> None:
    models = served.client.models.list()
    assert [m.id for m in models.data] == [BASE, ADAPTER, ADAPTER_2]
    assert {(m.object, m.owned_by) for m in models.data} == {("model", "orchestrator")}


def test_greedy_completion_is_what_transformers_generates(served: Served) -> None:
    ids = prompt_ids(PROMPT)
    expected = greedy(served.references[BASE], ids, 12)
    reply = served.client.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.model == BASE
    assert reply.choices[0].text == decode(expected)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 12)
    assert reply.usage.total_tokens == len(ids) + 12


def test_base_and_adapters_answer_side_by_side(served: Served) -> None:
    ids = prompt_ids(PROMPT)
    expected = {m: decode(greedy(ref, ids, 12)) for m, ref in served.references.items()}
    assert len(set(expected.values())) == 3  # the random LoRA weights matter

    def ask(model: str) -> str:
        reply = served.client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0
        )
        return reply.choices[0].text

    # Interleaved, so an adapter left active by one request would show in the next.
    order = [BASE, ADAPTER, ADAPTER_2, BASE, ADAPTER_2, ADAPTER, BASE]
    assert [ask(model) for model in order] == [expected[model] for model in order]


def test_chat_renders_the_chat_template(served: Served) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "user: What is the capital of France?\nassistant:"
    ids = tokenizer()(rendered, add_special_tokens=False)["input_ids"]
    for model in (BASE, ADAPTER):  # ADAPTER's own tokenizer files have no chat template
        reply = served.client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=10,
            temperature=0,  # type: ignore[arg-type]
        )
        assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content == decode(greedy(served.references[model], ids, 10))
        assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)


def test_a_stream_arrives_in_pieces_that_join_to_the_whole_text(served: Served) -> None:
    whole = served.client.completions.create(
        model=ADAPTER, prompt=PROMPT, max_tokens=12, temperature=0
    )
    chunks = list(
        served.client.completions.create(
            model=ADAPTER,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) > 1
    assert "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage == whole.usage


def test_a_chat_stream_starts_with_the_role_and_joins_to_the_reply(served: Served) -> None:
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    whole = served.client.chat.completions.create(
        model=BASE,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
    )
    chunks = list(
        served.client.chat.completions.create(
            model=BASE,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=10,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    pieces = [c.choices[0].delta.content for c in chunks[1:] if c.choices[0].delta.content]
    assert len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_stop_string_cuts_the_text_streamed_or_not(served: Served) -> None:
    full = served.client.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=12, temperature=0
    ).choices[0]
    # A string in the middle of the text, of whole characters: the random base model emits
    # byte tokens, and a character still being decoded shows as U+FFFD until it is whole.
    text = full.text
    stop = next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 2)
                if "\ufffd" not in text[i - 1 : i + 4])  # fmt: skip
    assert stop and text.find(stop) > 0
    expected = full.text[: full.text.find(stop)]

    cut = served.client.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    )
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    streamed = served.client.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_sampling_with_a_seed_is_reproducible(served: Served) -> None:
    def sample(seed: int) -> str:
        reply = served.client.completions.create(
            model=BASE, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed
        )
        return reply.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1  # it does sample


def test_an_unknown_model_is_not_found_and_the_served_ones_are_named(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        served.client.completions.create(model="no-such-model", prompt=PROMPT)
    assert caught.value.status_code == 404
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "NotFoundError"
    assert BASE in error["message"] and ADAPTER in error["message"]
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )


def test_requests_it_cannot_honour_are_bad_requests(served: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="n=2"):
        served.client.completions.create(model=BASE, prompt=PROMPT, n=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        served.client.completions.create(model=BASE, prompt=PROMPT, logprobs=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        served.client.completions.create(model=BASE, prompt=PROMPT, max_tokens=1000)


def test_a_malformed_body_is_a_400_in_openai_shape(served: Served) -> None:
    reply = served.http.post("/v1/completions", json={"model": BASE, "max_tokens": "many"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert "prompt" in error["message"] and "max_tokens" in error["message"]


def test_chat_without_a_chat_template_is_a_bad_request(tmp_path: Path) -> None:
    plain = tiny_lm.build_tokenizer()
    plain.chat_template = None
    tiny_lm.build_model(plain).save_pretrained(tmp_path)
    plain.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template is None
    with TestClient(build_app(TransformersEngine("plain-lm", tmp_path))) as http:
        client = openai_client(http)
        with pytest.raises(openai.BadRequestError, match="`plain-lm` has no chat template"):
            client.chat.completions.create(
                model="plain-lm", messages=[{"role": "user", "content": "hi"}]
            )
        assert client.completions.create(model="plain-lm", prompt=PROMPT, max_tokens=3)


def test_concurrent_requests_for_different_models_each_get_their_own(served: Served) -> None:
    ids = prompt_ids(PROMPT)
    expected = {m: decode(greedy(ref, ids, 40)) for m, ref in served.references.items()}
    order = [BASE, ADAPTER, ADAPTER_2] * 3

    def ask(model: str) -> str:
        reply = served.client.completions.create(
            model=model, prompt=PROMPT, max_tokens=40, temperature=0
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(max_workers=len(order)) as pool:
        answers = list(pool.map(ask, order))
    assert answers == [expected[model] for model in order]


def test_install_error_handlers_answers_in_openai_shape() -> None:
    api = FastAPI()
    install_error_handlers(api)

    @api.post("/typed")
    async def typed(body: CompletionRequest) -> dict[str, str]:
        raise ModelNotFoundError(f"The model `{body.model}` does not exist.", param="model")

    with TestClient(api) as http:
        malformed = http.post("/typed", json={"model": BASE})
        found = http.post("/typed", json={"model": "x", "prompt": "hi"})
    assert malformed.status_code == 400
    assert malformed.json()["error"]["type"] == "BadRequestError"
    assert "prompt" in malformed.json()["error"]["message"]
    assert found.status_code == 404
    assert found.json() == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
