"""Builders for a tiny, deterministic causal LM that needs no download.

Used by the tiny-lora recipe (`train.py`) and by tests of `orchestrator deploy_checkpoints`:
they need a real `transformers` model + tokenizer (with a chat template) that is built
offline in well under a second and fine-tunes on CPU in seconds.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
VOCAB_SIZE = 400

# Renders each message as "<role>: <content>\n"; the generation prompt is "assistant:".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Tokenizer training corpus: plain English, so common words become single tokens.
CORPUS = """\
The quick brown fox jumps over the lazy dog.
A journey of a thousand miles begins with a single step.
The cat sat on the mat and looked at the dog.
The dog sat on the rug and looked at the cat.
It was a bright cold day in April, and the clocks were striking thirteen.
All happy families are alike; each unhappy family is unhappy in its own way.
Call me Ishmael. Some years ago I went to sea.
The sun rises in the east and sets in the west.
Water boils at one hundred degrees at sea level.
She sells sea shells by the sea shore.
How much wood would a woodchuck chuck if a woodchuck could chuck wood?
The rain in Spain stays mainly in the plain.
To be or not to be, that is the question.
I think, therefore I am.
The early bird catches the worm.
An apple a day keeps the doctor away.
Knowledge is power, and time is money.
The system prints a message when the job is done.
The user asks a question and the assistant gives an answer.
Hello, how are you today? I am fine, thank you.
What is the capital of France? The capital of France is Paris.
Please write a short story about a robot who learns to paint.
The model was trained on a small set of sentences.
We went to the market to buy bread, milk, and eggs.
The children played in the park until the evening.
My favourite colours are red, green, and blue.
There are seven days in a week and twelve months in a year.
He opened the door, walked in, and sat down by the fire.
The train leaves the station at nine in the morning.
Numbers like 1, 2, 3, 10 and 100 appear in text too.
"""

# Fine-tuning texts: one rigid pattern, so a few steps visibly change greedy outputs.
TRAIN_TEXTS = [
    "the cat sat on the mat. the cat sat on the mat.",
    "the dog sat on the mat. the dog sat on the mat.",
    "the cat sat on the mat and the dog sat on the mat.",
    "the bird sat on the mat. the cat sat on the mat.",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on CORPUS; byte-level means any text round-trips."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    # Every encoding starts with <s>, in training and in serving alike.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama (~130k params); `seed` makes it reproducible.

    initializer_range is 0.2, not Llama's 0.02: with 0.02 the frozen lm_head yields near-uniform
    logits that a rank-8 LoRA on q/v cannot sharpen, so a LoRA fine-tune would barely learn.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention takes
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
