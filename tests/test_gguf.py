"""GGUF checkpoints: small Llama files written with the ``gguf`` package's own writer, one per
supported tensor type, convert to the dequantized reference weights (Q/K rows back in Hugging
Face order), agree with transformers' GGUF loader, decode like it, and are converted once;
unsupported files fail with sentences that name what is wrong. Also what ``--model`` resolves to.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from engine.checkpoints import gguf as converter
from engine.checkpoints import model_source
from engine.checkpoints.demo_model import build_demo_model
from engine.checkpoints.gguf import SUPPORTED_TYPES, find_gguf, gguf_checkpoint
from engine.checkpoints.model_source import DEMO_NAME, resolve_model
from engine.contracts.sampling_params import SamplingParams
from engine.worker.model.config import ModelConfig
from tests.test_scheduler import Harness, hf_greedy

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 2, 4, 2, 16
CONTEXT, ROPE_THETA, EPS = 256, 50000.0, 1e-5
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{'<|im_start|>assistant\\n'}}{% endif %}")


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A GPT-2 style vocabulary: the 256 byte symbols, two merges, three control tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e"]
    tokens += ["Ġt", "he", *SPECIALS]
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 3: control
    return tokens, merges, types


VOCAB = len(byte_level_vocab()[0])


def reference_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face names and layout; spreads large enough that greedy tokens depend on them."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=1.0),
               "model.norm.weight": 1 + normal(HIDDEN, std=0.1),
               "lm_head.weight": normal(VOCAB, HIDDEN, std=0.5)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + normal(HIDDEN, std=0.1),
            p + "post_attention_layernorm.weight": 1 + normal(HIDDEN, std=0.1),
            p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN, std=0.25),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=0.25),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=0.125),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM, std=0.125),
            p + "mlp.gate_proj.weight": normal(FFN, HIDDEN, std=0.125),
            p + "mlp.up_proj.weight": normal(FFN, HIDDEN, std=0.125),
            p + "mlp.down_proj.weight": normal(HIDDEN, FFN, std=0.1),
        }
    return weights


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, *module, _ = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.weight"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, weight.shape[1])
            .swapaxes(1, 2).reshape(weight.shape))


def add_tokenizer(writer: gguf.GGUFWriter, vocabulary: tuple[list[str], list[str], list[int]],
                  bos: str, eos: str, chat_template: str | None) -> None:
    """A GPT-2 style tokenizer's metadata (``vocabulary``: tokens, merges, token types)."""
    tokens, merges, types = vocabulary
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(bos))
    writer.add_eos_token_id(tokens.index(eos))
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_gguf(path: Path, qtype: gguf.GGMLQuantizationType, *, architecture: str = "llama",
               weights: dict[str, np.ndarray] | None = None, context: int = CONTEXT) -> Path:
    """A Llama GGUF as llama.cpp writes one: 2-D tensors in ``qtype``, norms in F32."""
    weights = reference_weights() if weights is None else weights
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(EPS)
    add_tokenizer(writer, byte_level_vocab(), "<|im_start|>", "<|im_end|>", CHATML)
    for name, value in weights.items():
        if "q_proj" in name:
            value = llama_cpp_permute(value, HEADS)
        elif "k_proj" in name:
            value = llama_cpp_permute(value, KV_HEADS)
        kind = qtype if value.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(gguf_name(name), quantize(value, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_weights(qtype: gguf.GGMLQuantizationType) -> dict[str, np.ndarray]:
    """The reference after a round trip through ``qtype`` (blocks run along rows, so permuting
    rows before quantizing and back after changes nothing)."""
    return {name: dequantize(quantize(value, qtype if value.ndim == 2 else
                                      gguf.GGMLQuantizationType.F32),
                             qtype if value.ndim == 2 else gguf.GGMLQuantizationType.F32)
            for name, value in reference_weights().items()}


# The K-quants need rows of 256 and a quantizer the gguf package lacks: tests/test_gguf_types.py
QTYPES = [gguf.GGMLQuantizationType[name] for name in SUPPORTED_TYPES if not name.endswith("_K")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """qtype name -> (GGUF file, converted directory)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for qtype in QTYPES:
        path = write_gguf(root / f"tiny-{qtype.name}.gguf", qtype)
        out[qtype.name] = (path, gguf_checkpoint(path, root / "cache"))
    return out


@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_each_supported_type_converts_to_the_dequantized_reference(converted, qtype):
    _, directory = converted[qtype.name]
    loaded = load_file(str(directory / "model.safetensors"))
    expected = expected_weights(qtype)
    assert sorted(loaded) == sorted(expected)
    stored = {"F16": torch.float16, "BF16": torch.bfloat16}.get(qtype.name, torch.float32)
    for name, want in expected.items():
        assert loaded[name].dtype == (stored if want.ndim == 2 else torch.float32), name
        assert torch.equal(loaded[name].float(), torch.from_numpy(want)), name


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "BF16"])
def test_transformers_reads_the_same_weights_and_config_from_the_file(converted, qtype):
    from transformers import AutoModelForCausalLM

    path, directory = converted[qtype]
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).state_dict()
    ours = load_file(str(directory / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), theirs[name]), name
    config = ModelConfig.from_dir(directory)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim,
            config.vocab_size, config.max_context_len, config.rope_theta, config.rms_norm_eps,
            config.tie_word_embeddings) == (LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, CONTEXT,
                                            ROPE_THETA, EPS, False)


def test_greedy_decoding_matches_transformers_on_the_gguf(converted):
    from transformers import AutoModelForCausalLM

    path, directory = converted["Q4_1"]
    oracle = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    h = Harness(str(directory), device="cpu", dtype="float32", page_size=4, num_pages=64)
    prompts = [[5, 70, 71, 72, 9, 99, 12], [5, 70, 71, 72, 9, 200, 13, 14]]  # a partial-page hit
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        h.add(str(i), prompt, params)
        h.run()
    assert [h.outputs[str(i)][0] for i in range(2)] == [hf_greedy(oracle, p, 6) for p in prompts]
    assert h.finals["1"][0].cached_tokens == 5


def test_the_tokenizer_and_chat_template_come_from_the_file(converted):
    from transformers import AutoTokenizer

    _, directory = converted["F32"]
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "the"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    tokens, _, _ = byte_level_vocab()
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokens.index("<|im_start|>")  # control tokens stay whole
    assert ids.count(tokens.index("<|im_start|>")) == 2 and tokens.index("<|im_end|>") in ids
    assert tokenizer(" the")["input_ids"] == [tokens.index("Ġt"), tokens.index("he")]
    assert tokenizer.decode(ids) == text


def test_a_second_start_reuses_the_conversion_and_a_changed_file_does_not(
        converted, tmp_path, monkeypatch):
    path, directory = converted["Q8_0"]
    cache = directory.parent

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(converter, "_convert", no_conversion)
    assert gguf_checkpoint(path, cache) == directory
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())  # the key is the content, not the path
    assert gguf_checkpoint(copy, cache) == directory
    monkeypatch.undo()
    changed = write_gguf(tmp_path / path.name, gguf.GGMLQuantizationType.Q8_0,
                         weights=reference_weights(seed=1))
    assert gguf_checkpoint(changed, cache) != directory


def test_a_directory_holding_one_gguf_names_it(tmp_path):
    assert find_gguf(tmp_path) is None
    (tmp_path / "a.gguf").write_bytes(b"")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    assert find_gguf(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        find_gguf(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path) is None  # an ordinary checkpoint directory


def test_what_model_resolves_to(converted, monkeypatch):
    path, directory = converted["F16"]
    # the demo model of the default cache, copied into this one: "demo" resolves to it
    # (building it is tests/test_demo_model.py's)
    built = build_demo_model()
    shutil.copytree(built, directory.parent / built.name)
    monkeypatch.setenv("RADIXSERVE_CACHE", str(directory.parent))
    assert resolve_model(str(path)) == model_source.ModelSource(str(directory), path.stem)
    assert resolve_model(str(directory)) == model_source.ModelSource(str(directory), None)
    demo = resolve_model("demo")
    assert demo.name == DEMO_NAME and (Path(demo.path) / "config.json").is_file()
    notices = []
    monkeypatch.setattr(model_source, "default_gguf", lambda: None)
    assert resolve_model(None, notice=notices.append) == demo
    assert len(notices) == 1 and model_source.DEFAULT_INSTALL in notices[0]


def test_a_big_model_is_written_in_shards_with_an_index(tmp_path, monkeypatch):
    from engine.checkpoints.model_source import weight_files

    monkeypatch.setattr(converter, "SHARD_BYTES", 64 << 10)  # the tiny model spans shards
    path = write_gguf(tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.F32)
    directory = gguf_checkpoint(path, tmp_path / "cache")
    files = weight_files(directory)
    assert len(files) > 2 and not (directory / "model.safetensors").exists()
    loaded = {}
    for file in files:
        loaded |= load_file(str(file))
    expected = expected_weights(gguf.GGMLQuantizationType.F32)
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[name], torch.from_numpy(want)) for name, want in expected.items())
