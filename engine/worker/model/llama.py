"""Every supported architecture in plain torch over a flat batch of tokens and paged KV.

Covers LlamaForCausalLM (Llama 2/3, with llama3 / linear / yarn RoPE scaling),
MistralForCausalLM (optional sliding window), Qwen2ForCausalLM (q/k/v bias),
Qwen3ForCausalLM (per-head q/k RMSNorm, explicit head_dim) and Gemma3ForCausalLM (four norms a
layer, GELU, scaled embeddings, sliding layers with their own RoPE), as the flags of
``ModelConfig`` describe them (engine/worker/model/architecture.py). The math follows
transformers' implementations of the same checkpoints (the parity oracle); only the data
layout differs:

- tokens of all sequences are one flat [T, hidden] batch, no padding;
- q/k/v and gate/up projections are fused into one matmul each (the loader fills the slices);
- attention reads and writes the paged KV pool through an ``AttentionBackend``;
- the final norm and lm_head run only on the rows whose logits are wanted;
- the residual stream is float32 whatever the weights' dtype: in bf16 each of a deep model's
  2 * layers additions would otherwise round it to 8 significant bits (SmolLM2-135M's first
  answer token to "What is the capital of France?" is a near-tie that this flips). The matmuls
  still run in the weights' dtype, on the normalised activations.

Weights are created directly on the target device and dtype and owned by the model; the loader
copies checkpoint tensors into the views ``weight_targets`` names (under tensor parallel, the
slices ``weight_sources`` names: engine/worker/model/parallel.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.attention.base import AttentionBackend
from engine.worker.lora_pool import LoraStep
from engine.worker.model.config import ModelConfig
from engine.worker.model.layer_ops import add_linear_, add_rms_norm_, rms_norm, silu_mul
from engine.worker.model.parallel import Collectives, ShardPlan, Slice, embed_vocab_parallel
from engine.worker.model.quant import part_sources
from engine.worker.model.rope import RotaryEmbedding
from engine.worker.model.row_tiles import DENSE_ROW_TILE
from engine.worker.model.weights import Weights, can_prepack


class DecoderLayer(Weights):
    """One layer, or (``tp`` given) this rank's share of it: ``plan``'s heads and MLP rows."""

    _LINEARS = ("qkv", "o", "gate_up", "down")

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 plan: ShardPlan, tp: Collectives | None = None,
                 formats: dict[str, tuple[str, ...]] | None = None) -> None:
        super().__init__(device, dtype)
        formats = formats or {}
        c = config
        self.eps, self.tp = c.rms_norm_eps, tp
        self.q_size, self.kv_size = plan.num_heads * c.head_dim, plan.num_kv_heads * c.head_dim
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        self.head_dim, self.intermediate_size = c.head_dim, plan.intermediate_size
        qkv_rows = self.q_size + 2 * self.kv_size
        self.input_norm = self._new(c.hidden_size)
        self._matrix("qkv", (self.q_size, self.kv_size, self.kv_size), c.hidden_size,
                     formats.get("qkv"))
        self.qkv_bias = self._new(qkv_rows) if c.qkv_bias else None
        self.q_norm = self._new(c.head_dim) if c.qk_norm else None
        self.k_norm = self._new(c.head_dim) if c.qk_norm else None
        self._matrix("o", (c.hidden_size,), self.q_size, formats.get("o"))
        self.o_bias = self._new(c.hidden_size) if c.o_bias else None
        self.mlp_norm = self._new(c.hidden_size)
        # Gemma 3's norms of the attention's and the MLP's outputs
        self.attn_out_norm = self._new(c.hidden_size) if c.sandwich_norms else None
        self.mlp_out_norm = self._new(c.hidden_size) if c.sandwich_norms else None
        self.gelu = c.activation == "gelu_tanh"
        self._matrix("gate_up", (plan.intermediate_size,) * 2, c.hidden_size,
                     formats.get("gate_up"))
        self.gate_up_bias = self._new(2 * plan.intermediate_size) if c.mlp_bias else None
        self._matrix("down", (c.hidden_size,), plan.intermediate_size, formats.get("down"))
        self.down_bias = self._new(c.hidden_size) if c.mlp_bias else None
        # On CPU, glibc serves allocations over 32 MiB with fresh mmaps, whose page faults cost
        # more than the GEMM that fills them; on GPU the bound just caps activation memory.
        budget = (16 << 20) if device.type == "cpu" else (1 << 30)
        self.mlp_chunk_tokens = max(1, budget // (2 * plan.intermediate_size * dtype.itemsize))
        # read every layer of every step: plain attributes, not nn.Module's parameter lookup
        self._qk_v_sizes = [self.q_size + self.kv_size, self.kv_size]
        self._mlp_norm = (self.mlp_norm,)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        q, kv, inter = self.q_size, self.kv_size, self.intermediate_size
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        targets = {
            prefix + "input_layernorm.weight": self.input_norm,
            **self._targets("qkv", attn + "q_proj.weight", slice(None, q)),
            **self._targets("qkv", attn + "k_proj.weight", slice(q, q + kv)),
            **self._targets("qkv", attn + "v_proj.weight", slice(q + kv, None)),
            **self._targets("o", attn + "o_proj.weight"),
            **self._targets("gate_up", mlp + "gate_proj.weight", slice(None, inter)),
            **self._targets("gate_up", mlp + "up_proj.weight", slice(inter, None)),
            **self._targets("down", mlp + "down_proj.weight"),
        }
        if self.attn_out_norm is None:
            targets[prefix + "post_attention_layernorm.weight"] = self.mlp_norm
        else:  # Gemma's names: "post" is after the block, not after attention
            targets[prefix + "post_attention_layernorm.weight"] = self.attn_out_norm
            targets[prefix + "pre_feedforward_layernorm.weight"] = self.mlp_norm
            targets[prefix + "post_feedforward_layernorm.weight"] = self.mlp_out_norm
        if self.qkv_bias is not None:
            targets[attn + "q_proj.bias"] = self.qkv_bias[:q]
            targets[attn + "k_proj.bias"] = self.qkv_bias[q : q + kv]
            targets[attn + "v_proj.bias"] = self.qkv_bias[q + kv :]
        if self.o_bias is not None:
            targets[attn + "o_proj.bias"] = self.o_bias
        if self.q_norm is not None:
            targets[attn + "q_norm.weight"] = self.q_norm
            targets[attn + "k_norm.weight"] = self.k_norm
        if self.gate_up_bias is not None:
            targets[mlp + "gate_proj.bias"] = self.gate_up_bias[:inter]
            targets[mlp + "up_proj.bias"] = self.gate_up_bias[inter:]
            targets[mlp + "down_proj.bias"] = self.down_bias
        return targets

    def forward(self, index: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionBackend, lora: LoraStep | None = None,
                x: torch.Tensor | None = None, next_norm: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Add this layer's attention and MLP outputs to ``hidden`` [T, hidden_size], the
        residual stream, in place (the model's forward owns it), and return it with its
        ``next_norm`` (the next layer's input norm, None after the last: nothing) RMSNorm,
        which the last addition computes as it adds (``add_rms_norm_``). ``x``: this layer's
        input norm of ``hidden`` where the layer before computed it. ``lora``: the step's
        adapters, whose updates each projection adds on top of the base weight's."""
        num_tokens = hidden.shape[0]
        if x is None:
            x = rms_norm(hidden, self.input_norm, self.eps)
        qkv = self._linear("qkv", x, self.qkv_bias)
        if lora is not None:
            lora.add_(index, "qkv", x, qkv)
        qk, v = qkv.split_with_sizes(self._qk_v_sizes, 1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((rms_norm(q, self.q_norm, self.eps),
                            rms_norm(k, self.k_norm, self.eps)), 1)
        # The backend rotates q and k (on CPU fused with storing K and V, engine/worker/cpu_kernels.py).
        out = attention.forward_rotating(index, qk, v, cos, sin).reshape(num_tokens, self.q_size)
        x = self._add_projection_(index, "o", hidden, out, self.o_bias, lora, self.attn_out_norm,
                                  norm=self._mlp_norm[0])
        # The MLP runs over row chunks so its widest temporary, [tokens, 2 * intermediate],
        # stays bounded however many tokens a prefill step carries.
        chunk = self.mlp_chunk_tokens
        if num_tokens <= chunk:
            return hidden, self._mlp_(index, hidden, x, lora, 0, next_norm)
        normed = [self._mlp_(index, rows, x_rows, lora, k * chunk, next_norm)
                  for k, (rows, x_rows) in enumerate(zip(hidden.split(chunk), x.split(chunk),
                                                         strict=True))]
        return hidden, None if next_norm is None else torch.cat(normed)

    def _mlp_(self, index: int, residual: torch.Tensor, x: torch.Tensor, lora: LoraStep | None,
              start: int, next_norm: torch.Tensor | None) -> torch.Tensor | None:
        """residual += the MLP of ``x`` (tokens [start, start + len(x)) of the step); returns
        the sum's ``next_norm`` RMSNorm (None without)."""
        gate_up = self._linear("gate_up", x, self.gate_up_bias)
        if lora is not None:
            lora.add_(index, "gate_up", x, gate_up, start)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh").mul_(up)
        else:
            act = silu_mul(gate_up)
        return self._add_projection_(index, "down", residual, act, self.down_bias, lora,
                                     self.mlp_out_norm, start, next_norm)

    def _add_projection_(self, index: int, name: str, residual: torch.Tensor, x: torch.Tensor,
                         bias: torch.Tensor | None, lora: LoraStep | None,
                         out_norm: torch.Tensor | None, start: int = 0,
                         norm: torch.Tensor | None = None) -> torch.Tensor | None:
        """residual += x @ W.T (+ bias) and the adapters' updates for the row-parallel
        projections (o, down; ``x`` is tokens [start, start + len(x)) of the step), normalised
        by ``out_norm`` first where the layer has one: under tensor parallel the ranks' partial
        products are summed first, each with its share of the updates, ``B (A_r x_r)``, so
        that the sum holds every update once. Returns the new residual rows' RMSNorm by
        ``norm`` (None without): where the product stands apart from the residual, the add
        and the norm are one op."""
        if self.tp is not None or out_norm is not None:
            out = self._linear(name, x)
            if lora is not None:
                lora.add_(index, name, x, out, start)
            if self.tp is not None:
                out = self.tp.all_reduce_(out)
            out = out if bias is None else out.add_(bias)
            residual.add_(out if out_norm is None else rms_norm(out, out_norm, self.eps))
            return None if norm is None else rms_norm(residual, norm, self.eps)
        if name in self.packed or name in self.quantized or self.row_tile:
            product = self._linear(name, x, bias)
            if norm is not None and lora is None:
                return add_rms_norm_(residual, product, norm, self.eps)
            residual.add_(product)
        else:
            add_linear_(residual, x, getattr(self, name), bias)
        if lora is not None:
            lora.add_(index, name, x, residual, start)
        return None if norm is None else rms_norm(residual, norm, self.eps)


class LlamaForCausalLM(Weights):
    """Every supported architecture: their differences are flags in ``ModelConfig``. With
    ``tp``, this rank's share of it (engine/worker/model/parallel.py); without, the whole model and
    no collective anywhere."""

    _LINEARS = ("lm_head",)

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 tp: Collectives | None = None, formats: dict[str, str] | None = None) -> None:
        """``formats``: checkpoint weight name -> the block format it is held in (the rest are
        dense in ``dtype``). Fused projections are quantized when all their parts are, in
        one format or several (one block layer for each); embeddings and the LM head only
        without tensor parallel."""
        super().__init__(device, dtype)
        self.config, self.tp, self.dtype = config, tp, dtype
        self.formats = formats = dict(formats or {})
        # weight signature -> the form of each row-count bucket (loader: linear_forms.py)
        self.linear_forms: dict[str, dict[str, str]] = {}
        self.plan = ShardPlan.for_rank(config, tp.rank if tp else 0, tp.size if tp else 1)
        rows, hidden = self.plan.vocab_rows, config.hidden_size
        self._matrix("embed", (rows,), hidden,
                     None if tp else _part_formats(formats, ("model.embed_tokens",)))
        self.layers = nn.ModuleList(
            DecoderLayer(config, device, dtype, self.plan, tp,
                         _layer_formats(formats, f"model.layers.{i}."))
            for i in range(config.num_layers)
        )
        self.norm = self._new(hidden)
        if config.tie_word_embeddings:
            self.lm_head = self.embed
            if "embed" in self.quantized:
                self.quantized["lm_head"] = self.quantized["embed"]
        else:
            self._matrix("lm_head", (rows,), hidden,
                         None if tp else _part_formats(formats, ("lm_head",)))
        # each layer, the next one's input norm (None after the last) and its sliding window
        self._layer_steps = [(layer, following.input_norm if following is not None else None,
                              window) for layer, following, window in
                             zip(self.layers, [*self.layers[1:], None], config.sliding_windows,
                                 strict=True)]
        self.rope = RotaryEmbedding(config, device)
        self.sliding_rope = (RotaryEmbedding(config, device, sliding=True)
                             if config.sliding_rope_theta is not None else None)
        real_rows = self.plan.vocab_stop - self.plan.vocab_start
        with torch.no_grad():  # the last rank's rows past the vocabulary: never loaded
            self.embed[real_rows:].zero_()
            self.lm_head[real_rows:].zero_()

    def prepack(self) -> None:
        """Lay the projection matrices out for oneDNN (see ``Weights``), once the weights are
        loaded; only where ``can_prepack`` holds and without tensor parallel. Afterwards
        ``weight_targets`` no longer names loadable tensors."""
        if self.tp is not None or not can_prepack(self.embed.device, self.embed.dtype):
            return
        self._prepack(keep=(self.embed,))
        for layer in self.layers:
            layer._prepack()

    def pin_row_order(self) -> None:
        """Make every dense product compute a row the same way whatever the rows beside it
        (``--deterministic``): in calls of ``DENSE_ROW_TILE`` rows (row_tiles.py). Products
        over quantized blocks need nothing: the block kernel computes each row alone (the
        runner pins it for every row count)."""
        for module in self.modules():
            if isinstance(module, Weights):
                module.row_tile = DENSE_ROW_TILE

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the tensor (or slice of a fused one) it is copied into."""
        real_rows = slice(None, self.plan.vocab_stop - self.plan.vocab_start)
        targets = {**self._targets("embed", "model.embed_tokens.weight", real_rows),
                   "model.norm.weight": self.norm}
        if not self.config.tie_word_embeddings:
            targets.update(self._targets("lm_head", "lm_head.weight", real_rows))
        for i, layer in enumerate(self.layers):
            targets.update(layer.weight_targets(f"model.layers.{i}."))
        return targets

    def weight_sources(self) -> dict[str, Slice]:
        """The checkpoint tensors this rank reads only a slice of (none without ``tp``)."""
        if self.tp is None:
            return {}
        vocab = self.plan.vocab_slice(self.config)
        sources = {"model.embed_tokens.weight": vocab}
        if not self.config.tie_word_embeddings:
            sources["lm_head.weight"] = vocab
        for i in range(self.config.num_layers):
            sources.update(self.plan.layer_sources(f"model.layers.{i}.", self.config))
        quantized = {name.removesuffix(".qweight") for name in self.weight_targets()
                     if name.endswith(".qweight")}
        for name in quantized & set(sources):
            sources.update(part_sources(name, sources.pop(name), self.formats[name]))
        return sources

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionBackend, logits_rows: torch.Tensor,
                lora: LoraStep | None = None) -> torch.Tensor | None:
        """Float32 logits [len(logits_rows), vocab] for a flat batch of new tokens [T]; under
        tensor parallel on rank 0 only (None on the others). ``lora``: the step's LoRA
        adapters (engine/worker/lora_pool.py), None when every row runs the base model."""
        hidden = self._embed(input_ids)
        rotations = self.rope(positions, self.dtype)
        sliding = self.sliding_rope(positions, self.dtype) if self.sliding_rope else rotations
        x = None  # each layer's input norm, computed by the layer before as it adds
        # ``forward`` called straight: nn.Module's call path (hooks) costs ~5 us a layer
        for index, (layer, next_norm, window) in enumerate(self._layer_steps):
            cos, sin = sliding if window else rotations
            hidden, x = layer.forward(index, hidden, cos, sin, attention, lora, x, next_norm)
        hidden = rms_norm(hidden.index_select(0, logits_rows), self.norm, self.config.rms_norm_eps)
        if "lm_head" in self.quantized:
            # float32 logits straight from the kernel's float accumulators: in bf16, close
            # candidates would round to ties that any small difference upstream breaks
            return self.quantized["lm_head"](hidden.float())
        if self.tp is None:
            return self._linear("lm_head", hidden).float()
        return self.tp.gather_vocab(F.linear(hidden, self.lm_head), self.config.vocab_size)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The float32 residual stream's first rows: the tokens' embeddings, times the
        architecture's scale in the model's dtype as transformers does (Gemma's sqrt(hidden):
        55.43 is 55.5 in bf16)."""
        scale = self.config.embedding_scale
        if "embed" in self.quantized:
            rows = self.quantized["embed"].rows_dense(
                input_ids, torch.float32 if scale is None else self.dtype)
        elif self.tp is None:
            rows = F.embedding(input_ids, self.embed)
        else:
            rows = embed_vocab_parallel(input_ids, self.embed, self.plan, self.tp)
        if scale is not None:
            rows = rows * torch.tensor(scale, dtype=rows.dtype)
        return rows.float()


def _layer_formats(formats: dict[str, str], prefix: str) -> dict[str, tuple[str, ...]]:
    """Layer ``prefix``'s weights (qkv, o, gate_up, down) -> each checkpoint part's format,
    for those whose parts are all held in blocks (a GGUF may mix formats inside a fused
    projection: Q4_K_M's Q6_K values beside Q4_K queries and keys)."""
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    groups = {"qkv": (attn + "q_proj", attn + "k_proj", attn + "v_proj"),
              "o": (attn + "o_proj",), "gate_up": (mlp + "gate_proj", mlp + "up_proj"),
              "down": (mlp + "down_proj",)}
    chosen = {}
    for name, parts in groups.items():
        found = _part_formats(formats, parts)
        if found is not None:
            chosen[name] = found
    return chosen


def _part_formats(formats: dict[str, str], parts: Sequence[str]) -> tuple[str, ...] | None:
    """The block format of each of ``parts`` (checkpoint weights, without ".weight"), or None
    when any of them is dense."""
    found = tuple(formats.get(part + ".weight") for part in parts)
    return None if None in found else found
