"""Generation with `transformers` (and `peft` for LoRA adapters) on CPU, one request at a time.

A base model and any number of LoRA adapters share one set of weights; which adapter is active
is global state of the model, so requests are serialised by a lock and each runs in a thread,
keeping the server's event loop free. Streamed and whole generations run the same token loop,
so a stream's pieces always join to the text the same request gets unstreamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchestrator.serving.openai_api import ChatMessage, Generation, SamplingParams
from orchestrator.serving.warm_up import WARM_UP_PROMPT

_DONE = object()


class TransformersEngine:
    """Serves `model_id` (the base) and each adapter id in `adapters` from one loaded model.

    `adapters` maps the id clients use (e.g. "tiny-lm:lora-checkpoint-30") to a directory written
    by peft's `save_pretrained`; tokenizer files in it are ignored: the base's tokenizer is used.
    """

    def __init__(
        self, model_id: str, model_dir: Path, adapters: dict[str, Path] | None = None
    ) -> None:
        if model_id in (adapters or {}):
            raise ValueError(f"The adapter id `{model_id}` is also the base model's id")
        self._base_id = model_id
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model, loading = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, ignore_mismatched_sizes=True, output_loading_info=True
        )
        _check_weights(loading)
        # peft names become module keys, which must not contain "." (ids often do).
        self._adapter_names = {aid: f"adapter_{i}" for i, aid in enumerate(adapters or {})}
        for adapter_id, directory in (adapters or {}).items():
            name = self._adapter_names[adapter_id]
            if name == "adapter_0":
                from peft import PeftModel  # only when needed: importing it takes seconds

                model = PeftModel.from_pretrained(model, directory, adapter_name=name)
            else:
                model.load_adapter(directory, adapter_name=name)
        self.model = model.eval()
        # transformers 5.24 renamed the KV cache argument and output `past_key_values` -> `cache`
        # (the old name warns, and goes in 5.40): use the one this model's forward declares.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        declared = inspect.signature(base.forward).parameters
        self._cache_arg = "cache" if "cache" in declared else "past_key_values"
        self._context = _context_length(self.model.config, self.tokenizer)
        self._eos_ids = _eos_ids(self.model.generation_config, self.tokenizer)
        self._lock = threading.Lock()

    def model_ids(self) -> list[str]:
        return [self._base_id, *self._adapter_names]

    def warm_up(self) -> None:
        """One greedy token of the base model through the token loop every request runs: a model
        that loads but cannot generate fails here, before the replica is ready, not at a client's
        first request."""
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        prompt_ids, params = self._check(self._base_id, WARM_UP_PROMPT, greedy)
        for _ in self._tokens_to_text(self._base_id, prompt_ids, params, threading.Event()):
            pass

    def chat_prompt(self, model_id: str, messages: list[ChatMessage]) -> list[int]:
        """Render `messages` with the tokenizer's chat template, ready for the assistant's turn."""
        self._require(model_id)
        if not self.tokenizer.chat_template:
            raise ValueError(
                f"The model `{model_id}` has no chat template (its tokenizer defines none), so it "
                "cannot serve /v1/chat/completions: use /v1/completions with a prompt, or train "
                "from a tokenizer that has a chat_template."
            )
        chat = [{"role": m.role, "content": m.content} for m in messages]
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        # The template writes any BOS itself, so tokenizing must not add another (as vLLM does).
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def generate(
        self, model_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Generation:
        """The whole completion of `prompt` for `model_id` (a ValueError if it cannot be served)."""
        prompt_ids, params = self._check(model_id, prompt, params)

        def run() -> Generation:
            pieces = list(self._tokens_to_text(model_id, prompt_ids, params, threading.Event()))
            last = pieces[-1]
            text = "".join(piece.text for piece in pieces)
            return Generation(text, last.prompt_tokens, last.completion_tokens, last.finish_reason)

        return await asyncio.to_thread(run)

    def stream(
        self, model_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[Generation]:
        """Pieces of text as tokens are produced; the request is checked before this returns."""
        prompt_ids, params = self._check(model_id, prompt, params)
        return self._stream(model_id, prompt_ids, params)

    async def _stream(
        self, model_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[Generation]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        stopped = threading.Event()  # the reader left (client gone): stop generating

        def post(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop closed under us
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def produce() -> None:
            try:
                for piece in self._tokens_to_text(model_id, prompt_ids, params, stopped):
                    post(piece)
            except Exception as err:
                post(err)
            post(_DONE)

        threading.Thread(target=produce, name="transformers-generate", daemon=True).start()
        try:
            while (item := await queue.get()) is not _DONE:
                if isinstance(item, Exception):
                    raise item
                assert isinstance(item, Generation)
                yield item
        finally:
            stopped.set()

    def _require(self, model_id: str) -> None:
        if model_id not in self.model_ids():
            served = ", ".join(self.model_ids())
            raise ValueError(f"The model `{model_id}` is not served here (served: {served})")

    def _check(
        self, model_id: str, prompt: str | list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        """Token ids of the prompt and a definite `max_tokens`, or a ValueError saying why not."""
        self._require(model_id)
        if isinstance(prompt, str):
            prompt = list(self.tokenizer(prompt)["input_ids"])
        if not prompt:
            raise ValueError("The prompt is empty: give at least one token")
        if bad := [t for t in prompt if not 0 <= t < self.model.config.vocab_size]:
            raise ValueError(f"The prompt has token ids outside the vocabulary: {bad[:5]}")
        room = self._context - len(prompt)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room or room < 1:
            raise ValueError(
                f"This model's maximum context length is {self._context} tokens. However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                f"{max_tokens} in the completion). Shorten the prompt or lower max_tokens."
            )
        return prompt, SamplingParams(
            max_tokens, params.temperature, params.top_p, params.stop, params.seed
        )

    def _tokens_to_text(
        self, model_id: str, prompt_ids: list[int], params: SamplingParams, stopped: threading.Event
    ) -> Iterator[Generation]:
        """Text pieces of one generation, the last with its finish_reason.

        Text that might be the start of a stop string, or half a UTF-8 character, is held back
        until the next token settles it.
        """
        assert params.max_tokens is not None
        completion: list[int] = []
        finish: Literal["stop", "length"] = "length"
        text, emitted = "", 0
        with self._lock, self._selected(model_id), torch.inference_mode():
            for token in self._tokens(prompt_ids, params):
                if stopped.is_set():
                    return
                completion.append(token)
                if token in self._eos_ids:
                    finish = "stop"
                    break
                text = self.tokenizer.decode(completion, skip_special_tokens=True)
                if (cut := _first_stop(text, params.stop)) is not None:
                    text, finish = text[:cut], "stop"
                    break
                if len(completion) == params.max_tokens:
                    break
                settled = len(text) - _held_back(text, params.stop)
                if settled > emitted:
                    yield Generation(text[emitted:settled], len(prompt_ids), len(completion))
                    emitted = settled
        yield Generation(text[emitted:], len(prompt_ids), len(completion), finish)

    def _tokens(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Next tokens, one forward pass each, reusing the KV cache; stops after max_tokens."""
        assert params.max_tokens is not None
        sampling = params.temperature > 1e-5
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        inputs, past = torch.tensor([prompt_ids]), None
        for _ in range(params.max_tokens):
            out = self.model(input_ids=inputs, use_cache=True, **{self._cache_arg: past})
            past, logits = getattr(out, self._cache_arg), out.logits[0, -1].float()
            if sampling:
                token = _sample(logits, params.temperature, params.top_p, generator)
            else:
                token = int(torch.argmax(logits))
            yield token
            inputs = torch.tensor([[token]])

    def _selected(self, model_id: str) -> contextlib.AbstractContextManager[object]:
        """Make `model_id` the one that runs: its adapter, or the base with adapters off."""
        if not self._adapter_names:
            return contextlib.nullcontext()
        if model_id == self._base_id:
            return self.model.disable_adapter()
        self.model.set_adapter(self._adapter_names[model_id])
        return contextlib.nullcontext()


def _check_weights(loading: dict[str, Any]) -> None:
    """Refuse weights that do not fit config.json, or are missing from the checkpoint: they would
    be served random. transformers' own error names none ("look at the above report", a report
    only the replica's log has), so this one names them."""
    problems = [
        f"{key} is {list(stored)} in the checkpoint, {list(wanted)} by config.json"
        for key, stored, wanted in sorted(loading.get("mismatched_keys") or [])
    ]
    problems += [f"{key} is missing" for key in sorted(loading.get("missing_keys") or [])]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(
            "The checkpoint's weights do not match its config.json: "
            f"{'; '.join(problems[:3])}{more}"
        )


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set of tokens whose mass reaches top_p (always the likeliest one).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen))


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters to hold: a possible stop string's start, or a partial char."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def _context_length(config: object, tokenizer: object) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(value := getattr(config, name, None), int):
            return value
    return int(getattr(tokenizer, "model_max_length", 2048))


def _eos_ids(generation_config: object, tokenizer: object) -> set[int]:
    """Every token that ends a generation: the generation config's and the tokenizer's EOS."""
    configured = getattr(generation_config, "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(getattr(tokenizer, "eos_token_id", None))
    return {i for i in ids if isinstance(i, int)}
