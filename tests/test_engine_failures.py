"""Why an engine failed, in one line, before any client asks it anything (no Ray).

The vLLM lines are what vLLM's CPU build wrote to a replica's worker log (`worker-*.out`, then
`worker-*.err`) when its engine died at the first request of a GPT-2 with head_dim 16; the
transformers engine is loaded here from checkpoints it cannot serve.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from orchestrator.serving.root_cause import ProcessOutput, error_line, root_cause, why
from orchestrator.serving.transformers_engine import TransformersEngine
from orchestrator.serving.warm_up import within

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes" / "tiny-lora"))
import tiny_lm  # noqa: E402

W = "(Worker pid=19112) ERROR 12-02 03:13:39 [multiproc_executor.py:1063] "
E = "(EngineCore pid=19070) ERROR 12-02 03:13:39 [core.py:1512] "
WORKER_OUT = f"""\
(EngineCore pid=19070) INFO 12-02 03:13:34 [compilation.py:317] Enabled custom fusions
{W}WorkerProc hit an exception.
{W}Traceback (most recent call last):
{W}  File "vllm/v1/executor/multiproc_executor.py", line 1055, in _execute_worker_rpc
{W}    output = func(*args, **kwargs)
{W}  File "torch/_ops.py", line 1279, in __call__
{W}    return self._op(*args, **kwargs)
{W}RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0
{E}EngineCore encountered a fatal error.
{E}Traceback (most recent call last):
{E}  File "vllm/v1/executor/multiproc_executor.py", line 444, in get_response
{E}    raise RuntimeError(
{E}RuntimeError: Worker failed with error 'Unsupported CPU attention configuration: \
head_dim=16 isa=2 kv_cache_idx=0', please check the stack trace above for the root cause
(MainProcess pid=18840) ERROR 12-02 03:13:39 [async_llm.py:906] \
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace \
(above) for the root cause.
"""
WORKER_ERR = """\
Traceback (most recent call last):
  File "vllm/v1/engine/async_llm.py", line 690, in generate
    out = q.get_nowait() or await q.get()
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace \
(above) for the root cause.
\x1b[36mINFO 2026-12-02 03:13:39,246 hd16_LLMServer:hd16 x70mihq9 -- CALL completions ERROR\x1b[0m
"""
ROOT = "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"


def test_the_root_cause_is_the_first_exception_that_is_not_a_pointer_to_another():
    assert root_cause(WORKER_OUT, WORKER_ERR) == ROOT
    # With only the replica's stderr, the pointer is all there is: said rather than nothing.
    assert root_cause(WORKER_ERR) == (
        "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the "
        "root cause."
    )
    assert root_cause("INFO all is well\n  File x\n") is None


def test_a_process_reads_back_only_what_it_wrote_after_its_mark(tmp_path):
    out, err = tmp_path / "worker.out", tmp_path / "worker.err"
    out.write_text("RuntimeError: from an earlier replica in this worker\n")
    err.write_text("")
    with out.open("a") as stdout, err.open("a") as stderr:
        fds = _redirected(stdout.fileno(), stderr.fileno())
        try:
            mark = ProcessOutput.mark()
            stdout.write(WORKER_OUT)
            stderr.write(WORKER_ERR)
            stdout.flush()
            stderr.flush()
            assert mark.root_cause(wait_s=0) == ROOT
            assert mark.since()[0] == WORKER_OUT
            # An error that only points at the root cause is told by it; any other by itself.
            dead = RuntimeError("EngineCore encountered an issue. See stack trace (above) for "
                                "the root cause.")  # fmt: skip
            assert why(dead, mark, wait_s=0) == ROOT
            assert why(ValueError("no such model type"), mark) == "ValueError: no such model type"
        finally:
            _restore(fds)


def test_error_line_is_the_errors_name_and_its_message_on_one_line():
    assert error_line(KeyError()) == "KeyError"
    # vLLM's when a config.json names no known model type: the reason is on the second line.
    vllm = RuntimeError(
        "Failed to create vLLM engine config: 1 validation error for ModelConfig\n"
        "  Value error, The checkpoint you are trying to load has model type `no-such-arch` "
        "but Transformers does not recognize this architecture. [type=value_error, "
        "input_value=ArgsKwargs((), {'model': '/x', 'runner': 'auto'}), input_type=ArgsKwargs]\n"
        "    For further information visit https://errors.pydantic.dev/2.12/v/value_error"
    )
    assert error_line(vllm) == (
        "RuntimeError: Failed to create vLLM engine config: 1 validation error for ModelConfig "
        "Value error, The checkpoint you are trying to load has model type `no-such-arch` but "
        "Transformers does not recognize this architecture."
    )
    assert len(error_line(ValueError("x" * 5000))) == len("ValueError: ") + 600


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_lm.build_tokenizer()


def _checkpoint(directory: Path, tokenizer, patch: dict | None = None) -> Path:
    tiny_lm.build_model(tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if patch:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **patch}))
    return directory


def test_weights_that_do_not_match_the_config_are_refused_naming_them(tmp_path, tokenizer):
    """transformers' own error says only "look at the above report" (printed to the log)."""
    model_dir = _checkpoint(tmp_path / "mismatch", tokenizer, {"hidden_size": 128})
    with pytest.raises(ValueError, match=r"do not match its config\.json") as raised:
        TransformersEngine("m", model_dir)
    assert "lm_head.weight is [400, 64] in the checkpoint, [400, 128] by config.json" in str(
        raised.value
    )
    assert "more)" in str(raised.value)  # every layer's weights, a few named


def test_a_model_that_loads_warms_up_with_one_token(tmp_path, tokenizer):
    engine = TransformersEngine("m", _checkpoint(tmp_path / "ok", tokenizer))
    engine.warm_up()  # raises if the model cannot generate


def test_a_model_that_loads_but_cannot_generate_fails_its_warm_up(tmp_path, tokenizer):
    """2 attention heads and 3 key-value heads: transformers loads it, its attention cannot run."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=3,
    )  # fmt: skip
    model_dir = tmp_path / "heads"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    engine = TransformersEngine("m", model_dir)
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(2\) must match"):
        engine.warm_up()


def test_a_warm_up_that_hangs_fails_at_its_deadline():
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no answer within 0\.3 s"):
        within(0.3, release.wait)
    assert 0.3 <= time.monotonic() - start < 5
    release.set()
    with pytest.raises(KeyError):  # what the call raises, when it ends in time
        within(5, lambda: {}.pop("x"))


def test_a_cause_never_shows_a_secret():
    e = OSError("401 for https://hub.example/api?token=hf_s3cr3t (hf_s3cr3t is not valid)")
    assert error_line(e, ["hf_s3cr3t", ""]) == (
        "OSError: 401 for https://hub.example/api?token=*** (*** is not valid)"
    )


def _redirected(out_fd: int, err_fd: int) -> tuple[int, int]:
    """Point this process's fds 1 and 2 at the files, as Ray does for a worker; the old ones."""
    saved = os.dup(1), os.dup(2)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    return saved


def _restore(saved: tuple[int, int]) -> None:
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    os.close(saved[0])
    os.close(saved[1])
