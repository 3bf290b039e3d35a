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

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.worker.model.config import ModelConfig
from engine.worker.model.llama import LlamaForCausalLM
from engine.worker.model.parallel import Collectives, Slice

# Checkpoint entries that carry nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in load order."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index} lists {file.name}, which is not in {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    others = [p.name for pattern in ("*.bin", "*.pt") for p in sorted(model_dir.glob(pattern))]
    hint = f" (found {', '.join(others)}; only safetensors weights are supported)" if others else ""
    raise FileNotFoundError(f"{model_dir} has no *.safetensors weights{hint}")


def load_model(model_dir: str | Path, *, device: torch.device, dtype: torch.dtype,
               config: ModelConfig | None = None, tp: Collectives | None = None,
               load_format: str = "auto", seed: int = 0) -> LlamaForCausalLM:
    """Build the model (``tp``: this rank's share of it) for ``model_dir``'s config on
    ``device`` and fill every weight: from the checkpoint's files, or (``load_format`` "dummy")
    with random values drawn on the device from ``seed``, which needs only config.json."""
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_dir(model_dir)
    if load_format == "dummy":
        model = LlamaForCausalLM(config, device, dtype, tp)
        _fill_random(model, seed)
        return model
    if load_format != "auto":
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    files = weight_files(model_dir)
    model = LlamaForCausalLM(config, device, dtype, tp)
    targets, sources = model.weight_targets(), model.weight_sources()
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    target = targets.get(name)
                    if target is None:
                        if name.endswith(_IGNORED_SUFFIXES) or (
                            name == "lm_head.weight" and config.tie_word_embeddings
                        ):
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
                    target.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        names = ", ".join(f.name for f in files)
        raise ValueError(f"weights missing from {names}: {shown}")
    return model


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
