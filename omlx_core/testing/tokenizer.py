"""A small byte-level BPE tokenizer with a ChatML chat template, trained in-process.

Test models need a tokenizer that behaves like a real one (byte-level BPE, special
tokens that encode to single ids, a chat template, multi-byte UTF-8) without a
download. Training on the embedded corpus takes a few milliseconds and is
deterministic, so every process produces the same ``tokenizer.json``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: 0, 1, 2, the same as SmolLM2's tokenizer.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

VOCAB_SIZE = 512

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# ChatML, shaped like SmolLM2-Instruct's template: a default system turn when the
# conversation does not start with one, and an open assistant turn on request.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_CORPUS = """\
The server keeps a careful account of every byte it hands out. Before a request is
allowed to run, the engine estimates how much memory the prompt will need, adds the
memory that the running requests already hold, and compares the sum with the ceiling.
If the request can never fit, the client is told at once, with the numbers that explain
why. If it fits alone but not next to the others, it waits in a short queue until
enough memory is free again.
A small model is useful for testing because it loads in a moment and answers quickly.
Its weights are random, so its answers are nonsense, but the shapes of its tensors, the
kinds of its caches and the way it is loaded are the same as for a large model.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with
a single step. Water boils at one hundred degrees at sea level, and freezes at zero.
The capital of France is Paris; the capital of Italy is Rome; the capital of Japan is
Tokyo. Seven days make a week, twelve months make a year, and there are four seasons:
spring, summer, autumn and winter.
What is the weather like today? It is sunny in the morning, cloudy in the afternoon,
and it will probably rain tonight. Please remember to bring an umbrella.
How do I bake bread? Mix flour, water, salt and yeast; knead the dough for ten minutes;
let it rise for an hour; shape the loaf; bake it in a hot oven until the crust is brown.
Numbers and symbols appear in text too: 1, 2, 3, 10, 42, 100, 2048, 3.14, 50%, $20,
x = y + 1, (a, b), [1, 2, 3], {"key": "value"}, user@example.com, #tag, A -> B.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
The assistant answers questions, writes short stories, summarizes documents and
explains code. The user asks, the assistant replies, and the conversation continues
one turn at a time. Thank you for your help! You are welcome; have a nice day.
Café, crème brûlée, naïve, façade, déjà vu, São Paulo, Zürich, Ångström, piñata.
Größe, Straße, über, schön, Äpfel, Öl, fünf, ça va, élève, garçon, señor, niño.
你好，世界。今天天气很好。我们一起去公园散步吧。
こんにちは、世界。今日はいい天気ですね。ありがとうございます。
안녕하세요, 세계. 만나서 반갑습니다.
Привет, мир. Спасибо большое.
Emoji: 😀 🎉 🚀 ❤️ 👍 🌍 🍕 🐍 ✨ 🤖
"""


@functools.lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """The trained tokenizer serialized as ``tokenizer.json`` text (cached per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocabulary, so any UTF-8 text round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TRAINING_CORPUS.splitlines(keepends=True), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"the test tokenizer trained to {tokenizer.get_vocab_size()} tokens, expected "
            f"{VOCAB_SIZE}; the embedded corpus is too small for VOCAB_SIZE (add text to "
            "TRAINING_CORPUS or lower VOCAB_SIZE)"
        )
    return tokenizer.to_str()


def special_token_id(token: str) -> int:
    """The id of one of ``SPECIAL_TOKENS``."""
    return SPECIAL_TOKENS.index(token)


def tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` contents for the test tokenizer."""
    return {
        # Named explicitly so transformers does not pick a model-specific tokenizer
        # class from config.json's model_type, which could rebuild the pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(out_dir: Path) -> None:
    """Write the test tokenizer's tokenizer.json and tokenizer_config.json to ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(trained_tokenizer_json(), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
