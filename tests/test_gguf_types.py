"""GGUF tensor types past Q4_0, Q4_1 and Q8_0: Q5_0 and Q5_1 (the gguf package quantizes them)
and the K-quants Q4_K and Q6_K (made from their byte layout, on a model whose rows are whole
256-weight super-blocks, typed as llama.cpp's Q4_K_M mix types a model) convert to exactly what
the gguf package dequantizes, decode like transformers loading the same file, and are served in
their own blocks under ``--quantization auto``; the types radixserve does not read, and a file
whose tensors disagree with its metadata, are refused with sentences."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from safetensors.torch import load_file

from engine.checkpoints.gguf import gguf_checkpoint
from engine.checkpoints.quant_formats import FILE, read_formats
from engine.contracts.sampling_params import SamplingParams
from engine.worker.model.quant import QuantizedLinear
from tests.test_gguf import CHATML, VOCAB, add_tokenizer, byte_level_vocab, write_gguf
from tests.test_quant import kquant_blocks
from tests.test_quant_models import forward, relative_error
from tests.test_scheduler import Harness, hf_greedy
from tests.test_tp import run_ranks

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64
PROMPTS = [[5, 70, 71, 72, 9, 99, 12], [5, 70, 71, 72, 9, 200, 13, 14]]
Q = gguf.GGMLQuantizationType


def q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M choices, in small: Q6_K for the LM head and for the value and down
    projections of the first layer, Q4_K elsewhere, and a Q8_0 tensor (its fallback for rows
    that are no whole super-blocks) for the last layer's down projection."""
    if name == "output.weight" or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        return "Q6_K"
    return "Q8_0" if name == "blk.1.ffn_down.weight" else "Q4_K"


def shapes() -> dict[str, tuple[int, ...]]:
    """GGUF name -> (rows, columns) of every tensor of the model, or (width,) for a norm."""
    found = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
             "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        found |= {f"blk.{i}.{name}.weight": shape for name, shape in {
            "attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,), "attn_q": (HEADS * HEAD_DIM, HIDDEN),
            "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_output": (HIDDEN, HEADS * HEAD_DIM), "ffn_gate": (FFN, HIDDEN),
            "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}.items()}
    return found


def write_model(path: Path, kind_of: Callable[[str], str] = q4_k_m, *, ffn: int = FFN,
                layers: int = LAYERS) -> Path:
    """A Llama GGUF of rows 256 and 512 wide, each matrix in ``kind_of(its name)``: random
    bytes for the K-quants and the types radixserve refuses (valid blocks once their float16
    scales are finite), the gguf package's quantizer for the others; norms in F32. ``ffn`` and
    ``layers`` are what the metadata says."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(writer, byte_level_vocab(), "<|im_start|>", "<|im_end|>", CHATML)
    for index, (name, shape) in enumerate(shapes().items()):
        if len(shape) == 1:
            writer.add_tensor(name, (1 + rng.normal(0, 0.1, shape)).astype(np.float32))
            continue
        kind = kind_of(name)
        if kind in ("Q4_K", "Q6_K"):
            data = kquant_blocks(kind, *shape, seed=index)
        elif kind in ("F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
            data = quantize(rng.normal(0, 0.1, shape).astype(np.float32), Q[kind])
        else:  # a type radixserve refuses: any bytes of its size
            block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
            data = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
        writer.add_tensor(name, data, raw_dtype=Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def greedy(directory: Path, oracle, **options) -> None:
    """Greedy tokens of two prompts (the second a partial-page hit) equal the oracle's."""
    h = Harness(str(directory), device="cpu", dtype="float32", page_size=4, num_pages=64,
                **options)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        h.add(str(i), prompt, params)
        h.run()
    assert [h.outputs[str(i)][0] for i in range(2)] == [hf_greedy(oracle, p, 6) for p in PROMPTS]


def transformers_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_q5_files_decode_like_transformers_dense_and_in_their_blocks(tmp_path, kind):
    """Q5_0 and Q5_1 (their weights' exactness: tests/test_gguf.py's per-type test) decode as
    transformers does under --quantization none and, held without loss in Q5_0's own 5-bit
    blocks and int8's 8-bit ones (Q5_1's), under auto (both get two activation digits)."""
    path = write_gguf(tmp_path / f"{kind}.gguf", Q[kind])
    directory = gguf_checkpoint(path, tmp_path / "cache")
    widened = {"Q5_0": "q5_0", "Q5_1": "int8"}[kind]
    assert set(read_formats(directory / FILE).values()) == {widened}
    oracle = transformers_model(path)
    greedy(directory, oracle, quantization="none")
    greedy(directory, oracle, quantization="auto")
    dense, _ = forward(str(directory), quantization="none")
    got, runner = forward(str(directory))
    assert set(runner.weight_formats) == {widened, "float32"}
    assert relative_error(got, dense) < 1e-3


@pytest.fixture(scope="module")
def k_quants(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("k_quants")
    path = write_model(root / "q4_k_m.gguf")
    return path, gguf_checkpoint(path, root / "cache")


def test_k_quants_convert_to_exactly_what_transformers_reads(k_quants):
    """Every tensor bit for bit as transformers loads the file (the gguf package's
    dequantization, Q/K rows in Hugging Face order), and greedy decoding like it."""
    path, directory = k_quants
    oracle = transformers_model(path)
    ours = load_file(str(directory / "model.safetensors"))
    theirs = oracle.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    greedy(directory, oracle, quantization="none")


def test_k_quants_are_served_in_their_own_blocks(k_quants):
    """--quantization auto keeps every K-quant tensor in blocks (the first layer's q/k/v, whose
    parts mix Q4_K and Q6_K, too: one block layer for each), computes close to the dense model
    and decodes greedily as transformers does."""
    path, directory = k_quants
    formats = read_formats(directory / FILE)
    assert formats["lm_head.weight"] == "q6_k" and formats["model.embed_tokens.weight"] == "q4_k"
    assert formats["model.layers.0.mlp.down_proj.weight"] == "q6_k"
    assert formats["model.layers.1.mlp.down_proj.weight"] == "q8_0"
    dense, _ = forward(str(directory), quantization="none")
    got, runner = forward(str(directory))
    assert set(runner.weight_formats) == {"q4_k", "q6_k", "q8_0", "float32"}
    assert "lm_head" in runner.model.quantized and "embed" in runner.model.quantized
    assert runner.model.layers[0].quantized["qkv"].format == "q4_k+q6_k"
    assert relative_error(got, dense) < 0.1
    greedy(directory, transformers_model(path), quantization="auto")


def mixed(name: str) -> str:
    """Fused projections whose parts differ in type: the first layer's q/k Q4_K beside v Q6_K
    (Q4_K_M's mix) and gate Q4_K beside up Q6_K; the second's q Q8_0, k Q6_K, v Q5_0 (three
    runs of three formats) and gate Q5_0 beside up Q4_1."""
    kinds = {"blk.0.ffn_up.weight": "Q6_K", "blk.1.attn_q.weight": "Q8_0",
             "blk.1.attn_k.weight": "Q6_K", "blk.1.attn_v.weight": "Q5_0",
             "blk.1.ffn_gate.weight": "Q5_0", "blk.1.ffn_up.weight": "Q4_1"}
    return kinds.get(name, q4_k_m(name))


def test_fused_projections_of_mixed_types_stay_in_their_blocks(tmp_path):
    """--quantization auto holds every part of a fused projection in its own blocks, one
    block layer for each run of one format (no dense copy: the only float32 weights are the
    norms); the fused layer gives each part's own product, bit for bit what that part's blocks
    give alone; the model computes close to the widened weights and splits over two
    tensor-parallel ranks. (Its greedy tokens under auto part from transformers' at a near-tie
    in this random model whether or not these projections are held in blocks; the Q4_K_M
    model's match: the test above.)"""
    path = write_model(tmp_path / "mixed.gguf", mixed)
    directory = gguf_checkpoint(path, tmp_path / "cache")
    dense, _ = forward(str(directory), quantization="none")
    got, runner = forward(str(directory))
    for layer in runner.model.layers:
        assert set(layer.quantized) == {"qkv", "o", "gate_up", "down"}
    assert runner.weight_formats["float32"] == (2 * LAYERS + 1) * HIDDEN * 4  # the norms
    assert set(runner.weight_formats) == {"q4_k", "q6_k", "q8_0", "q5_0", "q4_1", "float32"}
    first, second = runner.model.layers
    assert [first.quantized[name].format for name in ("qkv", "gate_up")] == [
        "q4_k+q6_k", "q4_k+q6_k"]
    assert [second.quantized[name].format for name in ("qkv", "gate_up")] == [
        "q8_0+q6_k+q5_0", "q5_0+q4_1"]
    assert relative_error(got, dense) < 0.1

    blocks = load_file(str(directory / FILE))
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    formats = read_formats(directory / FILE)
    for layer, name, parts in ((second, "qkv", ("q_proj", "k_proj", "v_proj")),
                               (second, "gate_up", ("gate_proj", "up_proj")),
                               (first, "qkv", ("q_proj", "k_proj", "v_proj"))):
        prefix = attn if name == "qkv" else mlp
        if layer is first:
            prefix = prefix.replace("layers.1", "layers.0")
        alone = []
        for part in parts:
            weight = prefix + part + ".weight"
            rows = blocks[weight + ".qweight"].shape[0]
            single = QuantizedLinear(formats[weight], rows, HIDDEN, torch.device("cpu"))
            for piece, tensor in single.parts().items():
                tensor.copy_(blocks[f"{weight}.{piece}"])
            single.repack()
            alone.append(single(x))
        assert torch.equal(layer.quantized[name](x), torch.cat(alone, dim=1)), name

    ranks = run_ranks(2, lambda tp: forward(str(directory), tp))
    for _, rank in ranks:  # each rank's rows of every part, in the same blocks
        assert rank.model.layers[1].quantized["qkv"].format == "q8_0+q6_k+q5_0"
        assert rank.model.layers[1].quantized["qkv"].rows == (HEADS + 2 * KV_HEADS) * HEAD_DIM // 2
    assert relative_error(ranks[0][0], got) < 0.05


def test_types_radixserve_does_not_read_are_named(tmp_path):
    others = {"token_embd.weight": "Q2_K", "blk.0.attn_q.weight": "Q3_K",
              "blk.0.ffn_up.weight": "Q5_K", "blk.1.ffn_gate.weight": "IQ4_XS"}
    path = write_model(tmp_path / "mixed.gguf", lambda name: others.get(name, q4_k_m(name)))
    with pytest.raises(ValueError, match=r"mixed\.gguf stores tensors as IQ4_XS, Q2_K, Q3_K, "
                                         r"Q5_K \(e\.g\. token_embd\.weight\), which radixserve "
                                         r"cannot read; supported GGUF tensor types: F32, F16, "
                                         r"BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K"):
        gguf_checkpoint(path, tmp_path / "cache")
    # nothing half-written left behind (the builders' lock file is no artefact)
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]


def test_a_k_quant_file_whose_tensors_disagree_with_its_metadata_is_refused(tmp_path):
    """The shapes checked are the tensors' weights, not their bytes (a K-quant row of 256
    weights is 144 bytes)."""
    path = write_model(tmp_path / "ffn.gguf", ffn=2 * FFN)
    with pytest.raises(ValueError, match=r"ffn\.gguf: tensor 'blk\.0\.ffn_gate\.weight' is "
                                         r"512 x 256 but the file's metadata .* implies "
                                         r"1024 x 256"):
        gguf_checkpoint(path, tmp_path / "cache")
