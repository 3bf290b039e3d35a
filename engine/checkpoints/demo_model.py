"""A small deterministic Llama checkpoint built offline, so radixserve runs with no download.

``build_demo_model()`` writes an ordinary Hugging Face checkpoint directory -- the same files a
real model has, loaded through the same path (and by transformers, the parity oracle)::

    <cache>/llama-demo-<key>/
        config.json             LlamaForCausalLM: hidden 256, 4 layers, 8 heads / 4 kv heads
        generation_config.json  bos, eos = [<|im_end|>, <|endoftext|>], pad
        model.safetensors       random fp32 weights from a fixed seed
        tokenizer.json          byte-level BPE trained on Python's own stdlib sources
        tokenizer_config.json   special tokens and a ChatML chat template
        special_tokens_map.json

``<key>`` hashes the builder version, the architecture, the init and tokenizer settings and the
training corpus bytes, so a different corpus (another Python version) gets its own directory
and an unchanged one is reused. ``engine.checkpoints.artifact_cache`` builds it once, renamed
into place whole, and says where ``<cache>`` is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.checkpoints.artifact_cache import build_once, default_cache_dir, write_json

BUILDER_VERSION = 1
SEED = 20240601

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2: the trainer puts them first
TOKENIZER_VOCAB_SIZE = 4096
VOCAB_MULTIPLE = 64  # the embedding is padded to this, as real checkpoints do

ARCHITECTURE = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

# Standard deviations. Unit-scale embeddings and fan-in-scaled projections keep every layer's
# contribution comparable to the residual stream, so outputs depend on the whole context. The
# wide lm_head gives logits a spread of ~4 nats, so greedy argmaxes have clear margins and fp32
# implementations agree token for token.
INIT_STD = {"embedding": 1.0, "lm_head": 0.25, "norm_noise": 0.1}

# ChatML. Content may be a string or OpenAI-style parts, of which the text parts are kept.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Tokenizer training text every Python installation ships: these stdlib modules (all present
# from 3.10 on), in this order. Prose-heavy docstrings plus code, about 3 MB, ~1 s to train.
CORPUS_FILES = tuple(
    """
    abc.py argparse.py ast.py base64.py bisect.py calendar.py cmd.py codecs.py
    collections/__init__.py configparser.py contextlib.py copy.py csv.py dataclasses.py
    difflib.py dis.py doctest.py email/message.py enum.py fnmatch.py fractions.py ftplib.py
    functools.py getopt.py gettext.py glob.py heapq.py hmac.py html/parser.py http/client.py
    imaplib.py inspect.py io.py ipaddress.py json/decoder.py json/encoder.py locale.py
    logging/__init__.py mimetypes.py numbers.py operator.py optparse.py os.py plistlib.py
    posixpath.py pprint.py pydoc.py queue.py random.py sched.py secrets.py selectors.py
    shlex.py shutil.py smtplib.py socket.py ssl.py statistics.py string.py subprocess.py
    tarfile.py tempfile.py textwrap.py threading.py timeit.py tokenize.py traceback.py
    typing.py unittest/case.py urllib/parse.py uuid.py warnings.py weakref.py
    """.split()
)

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _read_corpus() -> list[tuple[str, bytes]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [
        (name, (stdlib / name).read_bytes()) for name in CORPUS_FILES if (stdlib / name).is_file()
    ]
    if len(corpus) < len(CORPUS_FILES) // 2:
        raise RuntimeError(
            f"the demo model's tokenizer is trained on Python's standard library sources, but only "
            f"{len(corpus)} of {len(CORPUS_FILES)} files were found under {stdlib}; "
            f"install the full Python standard library or pass --model with a real checkpoint"
        )
    return corpus


def _content_key(corpus: list[tuple[str, bytes]]) -> str:
    settings = {
        "builder": BUILDER_VERSION,
        "seed": SEED,
        "architecture": ARCHITECTURE,
        "init": INIT_STD,
        "special_tokens": SPECIAL_TOKENS,
        "tokenizer_vocab_size": TOKENIZER_VOCAB_SIZE,
        "vocab_multiple": VOCAB_MULTIPLE,
        "chat_template": CHAT_TEMPLATE,
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for name, data in corpus:
        digest.update(f"\0{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def _train_tokenizer(corpus: list[tuple[str, bytes]]) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): any text, in any script, round-trips exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([data.decode("utf-8") for _, data in corpus], trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == expected_id, token
    return tokenizer


def _random_weights(vocab_size: int) -> dict[str, np.ndarray]:
    """LlamaForCausalLM parameters in fp32, drawn in a fixed order from one seeded generator."""
    rng = np.random.default_rng(SEED)
    arch = ARCHITECTURE
    hidden, inner = arch["hidden_size"], arch["intermediate_size"]
    q_width = arch["num_attention_heads"] * arch["head_dim"]
    kv_width = arch["num_key_value_heads"] * arch["head_dim"]

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return normal((out_features, in_features), in_features**-0.5)

    def norm() -> np.ndarray:
        # Not all ones: a checkpoint loader that drops norm weights must fail parity.
        return 1.0 + normal((hidden,), INIT_STD["norm_noise"])

    weights = {"model.embed_tokens.weight": normal((vocab_size, hidden), INIT_STD["embedding"])}
    for layer in range(arch["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        weights[prefix + "input_layernorm.weight"] = norm()
        weights[prefix + "self_attn.q_proj.weight"] = linear(q_width, hidden)
        weights[prefix + "self_attn.k_proj.weight"] = linear(kv_width, hidden)
        weights[prefix + "self_attn.v_proj.weight"] = linear(kv_width, hidden)
        weights[prefix + "self_attn.o_proj.weight"] = linear(hidden, q_width)
        weights[prefix + "post_attention_layernorm.weight"] = norm()
        weights[prefix + "mlp.gate_proj.weight"] = linear(inner, hidden)
        weights[prefix + "mlp.up_proj.weight"] = linear(inner, hidden)
        weights[prefix + "mlp.down_proj.weight"] = linear(hidden, inner)
    weights["model.norm.weight"] = norm()
    weights["lm_head.weight"] = normal((vocab_size, hidden), INIT_STD["lm_head"])
    return weights


def _write_checkpoint(directory: Path, corpus: list[tuple[str, bytes]]) -> None:
    tokenizer = _train_tokenizer(corpus)
    num_tokens = tokenizer.get_vocab_size()
    vocab_size = -(-num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    eos_ids = [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)]
    special_ids = {
        "bos_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
        "eos_token_id": eos_ids,
        "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
    }
    write_json(
        directory / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            **ARCHITECTURE,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
            "use_cache": True,
            **special_ids,
        },
    )
    write_json(directory / "generation_config.json", special_ids)
    save_file(
        _random_weights(vocab_size), str(directory / "model.safetensors"), metadata={"format": "pt"}
    )

    tokenizer.save(str(directory / "tokenizer.json"))
    special_tokens = {
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": [IM_START, IM_END],
    }
    write_json(directory / "special_tokens_map.json", special_tokens)
    write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_tokens,
            "add_bos_token": False,
            "add_eos_token": False,
            # Byte-level BPE decodes exactly; the "clean up" pass would rewrite " ." as ".".
            "clean_up_tokenization_spaces": False,
            "model_max_length": ARCHITECTURE["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )


def build_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Return the demo checkpoint's directory under ``cache_dir``, building it if missing."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus = _read_corpus()
    final = cache_dir / f"llama-demo-{_content_key(corpus)}"
    return build_once(final, lambda staging: _write_checkpoint(staging, corpus), MODEL_FILES)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m engine.checkpoints.demo_model",
        description="Build (or find) the offline demo checkpoint and print its directory.",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="cache directory to build under (default: $RADIXSERVE_CACHE, "
        "$XDG_CACHE_HOME/radixserve or ~/.cache/radixserve)",
    )
    args = parser.parse_args(argv)
    print(build_demo_model(args.out))


if __name__ == "__main__":
    main()
