"""GGUF files of Qwen2, Qwen3 and Gemma 3, written here as llama.cpp's converter writes them
(the ``gguf`` package's writer; Gemma's norms stored as 1 + w, no Q/K row interleaving), convert
to the weights and config that transformers' own GGUF loader reads from the same file, and the
engine's logits on them equal that model's in fp32, prompts past Gemma's sliding window
included. Gemma 3's default chat template and end of turn; files refused with sentences.

Dimensions follow what transformers' GGUF loader can express: it reads no head size for Qwen3
(Qwen3Config's default, 128, is used) and no ``query_pre_attn_scalar`` for Gemma 3 (256), so
those models have heads of 128 and 256 here, which llama.cpp's rules then agree with.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import quantize
from safetensors.torch import load_file

from engine.checkpoints.gguf import gguf_checkpoint
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.step import BatchInput
from engine.worker.model.config import ModelConfig
from tests.conftest_models import one_torch_thread
from tests.test_gguf import add_tokenizer
from tests.test_model_parity import Pages, make_runner, prefill
from tests.test_scheduler import Harness, hf_greedy

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

SPECIALS = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>")
WINDOW = 8
# architecture -> (HF architecture, config class, config fields)
MODELS = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        tie_word_embeddings=False)),
    # six layers: five slide over the last 8 positions, the sixth sees everything
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        sliding_window=WINDOW, query_pre_attn_scalar=256)),
}
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm",
}


def vocabulary() -> tuple[list[str], list[str], list[int]]:
    """A GPT-2 style vocabulary: the 256 byte symbols, two merges, control tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet()) + ["Ġt", "he", *SPECIALS]
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 3: control
    return tokens, ["Ġ t", "h e"], types


VOCAB = len(vocabulary()[0])


def gguf_tensor_name(hf_name: str, architecture: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    module = ".".join(module)
    if module == "post_attention_layernorm":
        module = "post_attention_norm" if architecture == "gemma3" else "ffn_norm"
    elif module == "pre_feedforward_layernorm":
        module = "ffn_norm"
    else:
        module = HF_TO_GGUF[module]
    return f"blk.{layer}.{module}.{kind}"


@functools.cache
def reference_weights(architecture: str) -> dict[str, np.ndarray]:
    """Hugging Face names and values of a random model; spreads large enough that greedy tokens
    depend on every weight (Gemma's norms around 0: it scales by 1 + w)."""
    hf_architecture, config_class, fields = MODELS[architecture]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
        rms_norm_eps=1e-6, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, hf_architecture)(config)
    weights = {}
    for name, param in model.state_dict().items():
        if name.endswith("norm.weight"):
            offset = 0.0 if architecture == "gemma3" else 1.0
            value = offset + 0.2 * torch.randn_like(param)
        elif name.endswith("bias"):
            value = 0.2 * torch.randn_like(param)
        else:
            value = 0.15 * torch.randn_like(param)
        weights[name] = value.numpy()
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def write_gguf(path: Path, architecture: str, qtype=gguf.GGMLQuantizationType.F32, *,
               weights: dict[str, np.ndarray] | None = None, chat_template: str | None = None,
               claimed: str | None = None) -> Path:
    """``architecture``'s GGUF as llama.cpp writes one: 2-D tensors in ``qtype``, 1-D in F32
    (``claimed``: the general.architecture written instead)."""
    weights = reference_weights(architecture) if weights is None else weights
    _, _, fields = MODELS[architecture]
    writer = gguf.GGUFWriter(path, claimed or architecture)
    writer.add_block_count(fields["num_hidden_layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(fields["num_attention_heads"])
    writer.add_head_count_kv(fields["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    if architecture == "gemma3":
        writer.add_rope_freq_base(1_000_000.0)
        writer.add_sliding_window(WINDOW)
    else:
        writer.add_rope_freq_base(50_000.0)
    if "head_dim" in fields:
        writer.add_key_length(fields["head_dim"])
        writer.add_value_length(fields["head_dim"])
    add_tokenizer(writer, vocabulary(), "<bos>", "<eos>", chat_template)
    for name, value in weights.items():
        if architecture == "gemma3" and name.endswith("norm.weight"):
            value = value + np.float32(1.0)  # llama.cpp's converter stores 1 + w
        kind = qtype if value.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(gguf_tensor_name(name, architecture), quantize(value, kind),
                          raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """architecture -> (GGUF file, converted directory), F32 tensors."""
    root = tmp_path_factory.mktemp("gguf-architectures")
    out = {}
    for architecture in MODELS:
        path = write_gguf(root / f"tiny-{architecture}.gguf", architecture)
        out[architecture] = (path, gguf_checkpoint(path, root / "cache"))
    return out


@functools.cache
def transformers_gguf_model(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()


@pytest.mark.parametrize("architecture", list(MODELS))
def test_transformers_reads_the_same_weights_from_the_file(converted, architecture):
    path, directory = converted[architecture]
    theirs = transformers_gguf_model(path).state_dict()
    ours = load_file(str(directory / "model.safetensors"))
    if "lm_head.weight" not in ours:  # tied: transformers lists the shared tensor twice
        theirs.pop("lm_head.weight")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    config = ModelConfig.from_dir(directory)
    hf_architecture, _, fields = MODELS[architecture]
    assert config.architecture == hf_architecture
    assert config.tie_word_embeddings == (architecture != "qwen3")
    assert config.head_dim == fields.get("head_dim", 16)
    if architecture == "gemma3":
        assert config.sliding_windows == (WINDOW,) * 5 + (None,)
        assert (config.rope_theta, config.sliding_rope_theta) == (1_000_000.0, 10_000.0)
        assert config.attention_scale == 256**-0.5 and config.norm_offset == 1.0


@pytest.mark.parametrize("architecture", list(MODELS))
def test_logits_match_transformers_loading_the_gguf(converted, architecture):
    """Teacher-forced logits of a 21-token prompt prefilled in two chunks and then decoded one
    token at a time equal transformers' (21 > Gemma's window of 8)."""
    path, directory = converted[architecture]
    runner = make_runner(directory, 4)
    pages = Pages(runner).take(32)
    ids = np.random.default_rng(3).integers(3, 256, 24).astype(np.int32)
    ours = [prefill(runner, pages, ids[:13]), prefill(runner, pages, ids[:21], cached=13)]
    for position in range(21, 24):
        batch = BatchInput.build([(pages, position, ids[position : position + 1])], 4)
        ours.append(runner.forward(batch))
    with torch.no_grad():
        expected = transformers_gguf_model(path)(torch.from_numpy(ids.astype(np.int64))[None])
    torch.testing.assert_close(torch.cat(ours), expected.logits[0], atol=1e-4, rtol=0)


def test_a_q8_0_gemma3_decodes_like_transformers(tmp_path):
    """The file's own Q8_0 blocks, served as they are (--quantization auto): the greedy tokens
    are transformers' on the same file."""
    path = write_gguf(tmp_path / "gemma3-q8.gguf", "gemma3", gguf.GGMLQuantizationType.Q8_0)
    directory = gguf_checkpoint(path, tmp_path / "cache")
    assert (directory / "quantized.safetensors").is_file()
    oracle = transformers_gguf_model(path)
    h = Harness(str(directory), device="cpu", dtype="float32", quantization="auto", page_size=4,
                num_pages=64)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 256, 14)]
    h.add("0", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    h.run()
    assert h.outputs["0"][0] == hf_greedy(oracle, prompt, 6)


def test_gemma3_without_a_template_gets_its_turn_format(converted):
    from transformers import AutoTokenizer

    _, directory = converted["gemma3"]
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the"},
         {"role": "assistant", "content": "he"}, {"role": "user", "content": "t"}],
        add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nthe<end_of_turn>\n"
                    "<start_of_turn>model\nhe<end_of_turn>\n"
                    "<start_of_turn>user\nt<end_of_turn>\n<start_of_turn>model\n")
    tokens, _, _ = vocabulary()
    eos = ModelConfig.from_dir(directory).eos_token_ids
    assert tokens.index("<end_of_turn>") in eos and tokens.index("<eos>") in eos


def test_a_template_in_the_file_wins(tmp_path):
    from transformers import AutoTokenizer

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = write_gguf(tmp_path / "g.gguf", "gemma3", chat_template=template)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_checkpoint(path, tmp_path / "cache")))
    assert tokenizer.chat_template == template


def test_another_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "phi.gguf", "qwen2", claimed="phi3")
    with pytest.raises(ValueError, match=r"phi\.gguf holds a 'phi3' model; radixserve reads "
                                         r"GGUF files of the architectures 'llama', 'qwen2', "
                                         r"'qwen3', 'gemma3' only"):
        gguf_checkpoint(path, tmp_path / "cache")


def test_tensors_that_do_not_match_the_metadata_are_named(tmp_path):
    weights = dict(reference_weights("qwen2"))
    no_bias = {k: v for k, v in weights.items() if not k.endswith("q_proj.bias")}
    path = write_gguf(tmp_path / "nobias.gguf", "qwen2", weights=no_bias)
    with pytest.raises(ValueError, match=r"nobias\.gguf lacks tensors that a qwen2 model of its "
                                         r"metadata \(2 layers\) has: blk\.0\.attn_q\.bias, "
                                         r"blk\.1\.attn_q\.bias"):
        gguf_checkpoint(path, tmp_path / "cache")
    weights["model.layers.1.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    path = write_gguf(tmp_path / "extra.gguf", "qwen2", weights=weights)
    with pytest.raises(ValueError, match=r"extra\.gguf has tensor 'blk\.1\.attn_q_norm\.weight', "
                                         r"which a qwen2 model of its metadata"):
        gguf_checkpoint(path, tmp_path / "cache")
    gemma = dict(reference_weights("gemma3"))
    gemma["model.layers.0.self_attn.k_norm.weight"] = np.zeros(128, np.float32)
    path = write_gguf(tmp_path / "shape.gguf", "gemma3", weights=gemma)
    with pytest.raises(ValueError, match=r"shape\.gguf: tensor 'blk\.0\.attn_k_norm\.weight' is "
                                         r"128 but the file's metadata .* implies 256"):
        gguf_checkpoint(path, tmp_path / "cache")
