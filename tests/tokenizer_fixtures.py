"""Small tokenizers trained offline for tests, built once per test session.

Two families cover what a serving engine meets in the wild:

- ``byte_level_tokenizer()``: GPT-2 style byte-level BPE. Its vocabulary is small, so accented,
  CJK and emoji characters (2-4 UTF-8 bytes) are often split across tokens, and random id
  sequences decode to broken characters (U+FFFD) in between.
- ``metaspace_tokenizer()``: SentencePiece / Llama 2 style: "▁" marks word starts, characters
  outside the learned alphabet fall back to ``<0xNN>`` byte tokens, and decoding strips the
  leading space of the text (``Strip`` decoder), so spacing depends on context.

Both speak ChatML (``<|im_start|>role\\n...<|im_end|>\\n``); the metaspace one also adds a BOS
token on encode and in its chat template, like Llama.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import TypeVar

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BOS_CHATML_TEMPLATE = "{{ bos_token }}" + CHATML_TEMPLATE

# Frequent lines teach the common words; the rare ones hold characters that byte-level BPE
# must split and that the metaspace alphabet leaves out (so they become byte tokens).
_COMMON_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "A serving engine streams text to the client one token at a time.",
    "Numbers like 3.14, 42 and 1,000,000 appear in text too.",
    "def add(a, b):\n    return a + b\n",
    "Le café est très bon, merci beaucoup.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "El niño comió una manzana en la mañana.",
)
_RARE_LINES = (
    "你好，世界！今天天气很好。",
    "日本語のテキストも少しあります。",
    "한국어 문장도 있습니다.",
    "Emoji: 😀 🎉 🚀 ❤️ 👍🏽 and a flag 🇫🇷.",
    "Math: ∑ x² ≤ ∞, α β γ δ, → ⇒ ∀ ∃.",
    "Ελληνικά και русский текст.",
)
CORPUS: tuple[str, ...] = _COMMON_LINES * 20 + _RARE_LINES * 2

BYTE_LEVEL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
METASPACE_SPECIALS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")


@functools.cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE with ChatML specials; no BOS is added on encode."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(BYTE_LEVEL_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2 style "▁" BPE with byte fallback, a BOS on encode, and ChatML specials."""
    # The trainer cannot learn byte-fallback tokens, so train plain BPE first and rebuild the
    # model with the 256 ``<0xNN>`` tokens placed after the specials, as Llama's vocab has them.
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    learner.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=500, limit_alphabet=70, show_progress=False)
    )
    learned = json.loads(learner.to_str())["model"]
    vocab = {token: index for index, token in enumerate(METASPACE_SPECIALS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(pair) for pair in learned["merges"]]

    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(list(METASPACE_SPECIALS))
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=BOS_CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


ItemsT = TypeVar("ItemsT", bound=Sequence)


def chunked(items: ItemsT, sizes: Sequence[int]) -> list[ItemsT]:
    """Split token ids or text into consecutive steps of the given sizes, cycled.

    A size of 0 makes an empty step, as a decode step that produced no new text does.
    """
    if not any(sizes):
        sizes = [1]
    steps, start, index = [], 0, 0
    while start < len(items):
        size = sizes[index % len(sizes)]
        steps.append(items[start : start + size])
        start += size
        index += 1
    return steps


TOKENIZERS = {"byte_level": byte_level_tokenizer, "metaspace": metaspace_tokenizer}


@functools.cache
def byte_fallback_ids(tokenizer: PreTrainedTokenizerFast) -> frozenset[int]:
    """Ids of the ``<0xNN>`` byte tokens (empty for the byte-level tokenizer); looked up once
    per tokenizer, whose vocabulary the property tests ask for at every example."""
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[f"<0x{b:02X}>"] for b in range(256) if f"<0x{b:02X}>" in vocab)
