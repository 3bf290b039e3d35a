"""Load a Hugging Face checkpoint directory into ``LlamaForCausalLM``.

Reads ``config.json`` (+ ``generation_config.json``) and the safetensors weights: one
``model.safetensors``, a sharded set listed by ``model.safetensors.index.json``, or any
``*.safetensors`` files. Tensors are read one at a time and copied straight into the model's
(fused) parameters on the target device and dtype, so peak host memory is one tensor. Under
tensor parallel each rank reads only its slice of the tensors it splits (``weight_sources``).

Every failure is a sentence naming the file and key: missing config or weights, unsupported
architecture (from ``ModelConfig``), a key the model does not have, a missing key, a shape
mismatch.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from engine.checkpoints.model_source import weight_files
from engine.checkpoints.quant_formats import read_formats
from engine.checkpoints.quantized import LINEAR, quantized_file
from engine.worker.cpu_kernels import quant_ops
from engine.worker.model.config import ModelConfig
from engine.worker.model.linear_forms import choose_forms
from engine.worker.model.llama import LlamaForCausalLM
from engine.worker.model.parallel import Collectives, Slice

logger = logging.getLogger("radixserve.worker")

# Checkpoint entries that carry nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_dir: str | Path, *, device: torch.device, dtype: torch.dtype,
               config: ModelConfig | None = None, tp: Collectives | None = None,
               load_format: str = "auto", seed: int = 0,
               quantization: str = "none", linear_form: str = "auto",
               resident_bytes: int = 0) -> LlamaForCausalLM:
    """Build the model (``tp``: this rank's share of it) for ``model_dir``'s config on
    ``device`` and fill every weight: from the checkpoint's files, or (``load_format`` "dummy")
    with random values drawn on the device from ``seed``, which needs only config.json.
    ``quantization`` (engine/checkpoints/quantized.py) says which weights stay in blocks,
    ``linear_form`` how their products run (engine/worker/model/linear_forms.py), with bf16
    copies of at most ``resident_bytes`` beside the blocks."""
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_dir(model_dir)
    if load_format == "dummy":
        if quantization in ("int8", "int4"):
            raise ValueError(f"--load-format dummy has no weights to quantize to {quantization}; "
                             "use --quantization none or auto with it")
        model = LlamaForCausalLM(config, device, dtype, tp)
        _fill_random(model, seed)
        return model
    if load_format != "auto":
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    quantized = quantized_file(model_dir, quantization)
    formats = _formats(quantized, quantization, device)
    files = weight_files(model_dir) + ([quantized] if formats else [])
    model = LlamaForCausalLM(config, device, dtype, tp, formats)
    targets, sources = model.weight_targets(), model.weight_sources()
    if quantization in ("int8", "int4"):
        dense = sorted(name for name in targets if LINEAR.fullmatch(name))
        if dense:
            logger.info("--quantization %s: %d projections stay in %s, their rows not whole "
                        "groups of 32 (%s)", quantization, len(dense), str(dtype).removeprefix(
                            "torch."), ", ".join(dense))
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    target = targets.get(name)
                    if target is None:
                        # skipped: a dense weight held quantized, and quantized parts of one
                        # held dense (tensor parallel's embeddings, a fused projection with a
                        # dense part), which the dense file holds too
                        if name.endswith(_IGNORED_SUFFIXES) or (
                            name == "lm_head.weight" and config.tie_word_embeddings
                        ) or f"{name}.qweight" in targets or file == quantized:
                            continue
                        raise ValueError(f"{file.name} has tensor {name!r}, which "
                                         f"{config.architecture} with this config.json does not "
                                         "have; is config.json from the same checkpoint?")
                    source = sources.get(name)
                    if source is None:
                        tensor = reader.get_tensor(name)
                        shape, expected = tuple(tensor.shape), tuple(target.shape)
                    else:
                        tensor, shape, expected = _read_slice(reader, name, source, target)
                    if shape != expected:
                        raise ValueError(f"{file.name}: tensor {name!r} has shape {shape} but "
                                         f"config.json implies {expected}")
                    if config.norm_offset and name.endswith("norm.weight"):
                        tensor = tensor.float() + config.norm_offset  # Gemma's 1 + w, once
                    target.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        names = ", ".join(f.name for f in files)
        raise ValueError(f"weights missing from {names}: {shown}")
    for module in model.modules():  # the blocks as the kernel reads them, once loaded
        for blocks in set(getattr(module, "quantized", {}).values()):
            blocks.repack()
    if formats:
        model.linear_forms = choose_forms(model, linear_form, dtype, quantized.parent,
                                          resident_bytes)
    return model


def _formats(quantized: Path | None, quantization: str, device: torch.device
             ) -> dict[str, str]:
    """Checkpoint name -> block format of the weights served quantized (none: {})."""
    if quantized is None:
        return {}
    formats = read_formats(quantized)
    kinds = ", ".join(sorted(set(formats.values())))
    if device.type != "cpu":
        if quantization != "auto":
            raise ValueError(f"--quantization {quantization} keeps the weights in blocks "
                             f"({kinds}), which radixserve computes on CPU only; serve them on "
                             f"{device.type} with --quantization auto or none (widened to "
                             "--dtype at load)")
        logger.warning("the checkpoint's %s weights are widened to the model's dtype: their "
                       "blocks are computed on CPU only", kinds)
        return {}
    if quant_ops() is None:
        if quantization != "auto":
            raise RuntimeError(f"--quantization {quantization} needs the compiled CPU kernels, "
                               "which are not available here (see the log above); use "
                               "--quantization none")
        logger.warning("the checkpoint's %s weights are widened to the model's dtype: the "
                       "compiled CPU kernels that read them are not available", kinds)
        return {}
    return formats


@torch.no_grad()
def _fill_random(model: LlamaForCausalLM, seed: int) -> None:
    """Weights like a freshly initialised checkpoint's: norms 1, biases 0, matrices N(0, 0.02)
    (small enough that activations stay finite through any number of layers)."""
    generator = torch.Generator(device=model.embed.device).manual_seed(seed)
    for name, target in model.weight_targets().items():
        if name.endswith("norm.weight"):
            target.fill_(1.0)
        elif name.endswith(".bias"):
            target.zero_()
        else:
            target.normal_(0.0, 0.02, generator=generator)


def _read_slice(reader, name: str, source: Slice, target: torch.Tensor
                ) -> tuple[torch.Tensor | None, tuple[int, ...], tuple[int, ...]]:
    """This rank's slice of checkpoint tensor ``name``, the tensor's full shape and the full
    shape the config implies (the slice is read only when the two agree)."""
    piece = reader.get_slice(name)
    shape = tuple(piece.get_shape())
    expected = list(target.shape)
    expected[source.dim] = source.full
    if shape != tuple(expected):
        return None, shape, tuple(expected)
    index = (slice(None),) * source.dim + (slice(source.start, source.stop),)
    return piece[index], shape, shape
