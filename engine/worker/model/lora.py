"""LoRA adapters in PEFT's format, read and checked against the base model's shapes.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors`` with, for each
adapted projection, ``...layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r]; the projection's output becomes ``W x + s B A x`` with
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).

The model fuses q/k/v and gate/up into one matmul each (engine/worker/model/llama.py), so an
adapter is kept the same way: per layer and fused projection, the targeted parts' A matrices
stacked ([parts * r, in]) and their B matrices block-diagonal, held transposed
([parts * r, out], zero where a part is not targeted, the scale folded in; transposed as the
worker's slots hold them, engine/worker/lora_pool.py). One low-rank product then updates every
part.

Under tensor parallel each rank keeps its share, split as its base weight is
(engine/worker/model/parallel.py): ``W = B A``, so A takes the base weight's split of the
input and B its split of the output. Column-parallel q/k/v and gate/up: A whole, B only this
rank's output rows of each part. Row-parallel o and down: A only this rank's input columns, B
whole; each rank's ``B (A_r x_r)`` joins its partial product before the all-reduce, whose sum
over ranks is ``B A x``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.worker.model.config import ModelConfig
from engine.worker.model.parallel import ShardPlan, Slice

# PEFT's module name -> (the fused projection holding it, its place among the fused parts)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
           "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "down_proj": ("down", 0)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def projection_shapes(config: ModelConfig, plan: ShardPlan | None = None
                      ) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Fused projection -> (input features, each part's output features) of ``plan``'s rank
    (the whole model's without)."""
    share = config if plan is None else plan
    q, kv = share.num_heads * config.head_dim, share.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, share.intermediate_size
    return {"qkv": (hidden, (q, kv, kv)), "o": (q, (hidden,)),
            "gate_up": (hidden, (inter, inter)), "down": (inter, (hidden,))}


@dataclass
class LoraWeights:
    """One adapter on the host: ``mats[(layer, fused)] = (A, B^T)`` in float32 (the scale in
    B), only for the projections it adapts; under tensor parallel, this rank's share."""

    name: str
    rank: int
    content_hash: str
    mats: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.mats.values())


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                 plan: ShardPlan | None = None) -> LoraWeights:
    """Read the PEFT adapter at ``path`` (``plan``'s share of it; all of it without);
    ValueError with a sentence naming what does not fit the base model or the limits."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(f"LoRA adapter {name!r}: {needed} does not exist (a PEFT adapter "
                             "directory holds adapter_config.json and adapter_model.safetensors)")
    raw_config, raw_weights = config_file.read_bytes(), weights_file.read_bytes()
    settings = json.loads(raw_config)
    rank, scale = _check_settings(name, settings, max_rank)
    tensors = load_file(str(weights_file))
    parts: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
    shapes = projection_shapes(config)  # the files hold the whole model's matrices
    splits = _splits(config, plan)
    for key, tensor in tensors.items():
        found = _KEY.search(key)
        if found is None or found.group(2) not in MODULES:
            raise ValueError(f"LoRA adapter {name!r} holds {key}, which is not the LoRA A or B "
                             "matrix of a q/k/v/o/gate/up/down projection")
        layer, module, which = int(found.group(1)), found.group(2), found.group(3)
        if layer >= config.num_layers:
            raise ValueError(f"LoRA adapter {name!r} adapts layer {layer} but the base model "
                             f"has {config.num_layers} layers")
        fused, part = MODULES[module]
        in_features, outs = shapes[fused]
        expected = (rank, in_features) if which == "A" else (outs[part], rank)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"LoRA adapter {name!r}: {key} is {list(tensor.shape)} but the base "
                             f"model's {module} needs {list(expected)} (rank {rank}, "
                             f"{in_features} inputs, {outs[part]} outputs)")
        parts.setdefault((layer, fused), {}).setdefault(part, {})[which] = _share(
            tensor.float(), which, splits.get(module))
    mats, rank_shapes = {}, projection_shapes(config, plan)
    for (layer, fused), by_part in parts.items():
        for part, pair in by_part.items():
            if len(pair) != 2:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s part {part} of "
                                 f"{fused} has a lora_{next(iter(pair))} matrix but not the "
                                 "other one")
        mats[(layer, fused)] = _fuse(by_part, rank_shapes[fused][1], rank, scale)
    if not mats:
        raise ValueError(f"LoRA adapter {name!r} adapts no projection")
    digest = hashlib.sha256(raw_config + b"\0" + raw_weights).hexdigest()[:16]
    return LoraWeights(name, rank, digest, mats)


def _splits(config: ModelConfig, plan: ShardPlan | None) -> dict[str, Slice]:
    """PEFT module name -> the slice of its base weight that ``plan``'s rank holds (none
    without tensor parallel)."""
    if plan is None or plan.size == 1:
        return {}
    sources = plan.layer_sources("", config)
    return {key.split(".")[1]: part for key, part in sources.items() if key.endswith(".weight")}


def _share(tensor: torch.Tensor, which: str, split: Slice | None) -> torch.Tensor:
    """This rank's part of a lora_A [r, in] or lora_B [out, r] matrix: A is split as its base
    weight's input (dim 1), B as its output (dim 0)."""
    if split is None or split.dim != (1 if which == "A" else 0):
        return tensor
    return tensor.narrow(split.dim, split.start, split.stop - split.start)


def _check_settings(name: str, settings: dict, max_rank: int) -> tuple[int, float]:
    """The rank and scale ``settings`` (adapter_config.json) give, refusing what is not plain
    LoRA on the supported projections."""
    if settings.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r} is a {settings['peft_type']} adapter; only LoRA "
                         "adapters can be served")
    rank = settings.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r} has no positive integer rank 'r'")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank} but --max-lora-rank is "
                         f"{max_rank}")
    for unsupported in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if settings.get(unsupported):
            raise ValueError(f"LoRA adapter {name!r} uses {unsupported}, which radixserve "
                             "does not serve")
    if settings.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r} trains biases (bias={settings['bias']!r}); "
                         "only bias='none' adapters can be served")
    targets = settings.get("target_modules") or []
    if isinstance(targets, str) and targets != "all-linear":
        raise ValueError(f"LoRA adapter {name!r} names its target modules by the pattern "
                         f"{targets!r}; give them as a list")
    unknown = sorted(set([] if isinstance(targets, str) else targets) - set(MODULES))
    if unknown:
        raise ValueError(f"LoRA adapter {name!r} targets {', '.join(unknown)}; only "
                         f"{', '.join(MODULES)} can be adapted")
    alpha = settings.get("lora_alpha", 8)
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return rank, scale


def _fuse(by_part: dict[int, dict[str, torch.Tensor]], outs: tuple[int, ...], rank: int,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked A [k * rank, in] and block-diagonal scaled B, transposed [k * rank, sum(outs)],
    of the k parts present, in part order."""
    present = sorted(by_part)
    a = torch.cat([by_part[p]["A"] for p in present])
    bt = torch.zeros(len(present) * rank, sum(outs))
    for block, part in enumerate(present):
        column = sum(outs[:part])
        bt[block * rank : (block + 1) * rank, column : column + outs[part]] = (
            by_part[part]["B"].t() * scale)
    return a.contiguous(), bt
