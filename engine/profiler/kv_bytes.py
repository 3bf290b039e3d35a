"""What one cached token costs in bytes: caches sized in GiB, and what an 8-bit KV cache buys.

    bytes per token = 2 (K and V) x layers x KV heads x row bytes
    row bytes       = head_dim x bytes per value        bfloat16, float16 (2), float32 (4), fp8 (1)
                    = head_dim + 2                      int8: a float16 scale ends every row

This is the layout of the worker's pool (``KVPool.bytes_per_page`` in engine/worker/kv_pool.py,
int8 rows in engine/worker/kv_quant.py ``row_width``). The profiler runs without torch and sits
below the worker's layer, so it cannot call those; tests/test_profiler_bytes.py checks that the
two agree for every ``--kv-cache-dtype``.

A model's shape comes from its config.json (``num_hidden_layers``, ``num_key_value_heads``,
``head_dim``, with engine/worker/model/config.py's fallbacks) or from a GGUF file's metadata
(the keys engine/checkpoints/gguf.py converts); no weights are read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.contracts.engine_config import EngineConfig
from engine.contracts.options import declared_options

GIB = 1 << 30
# The engine's --kv-cache-dtype names, from its one declaration.
KV_CACHE_DTYPES: tuple[str, ...] = next(
    option.choices for option in declared_options(EngineConfig)
    if option.name == "kv_cache_dtype")
VALUE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}
INT8_SCALE_BYTES = 2  # a float16 scale per (token, KV head) row
INT8 = "int8"
# What --kv-cache-dtype auto stores when the checkpoint names no dtype (a GGUF file): the
# engine's default on a GPU.
DEFAULT_MODEL_DTYPE = "bfloat16"


class ShapeError(ValueError):
    """A checkpoint whose KV shape cannot be read."""


@dataclass(frozen=True)
class KVShape:
    """The part of a model that sets its KV cache's size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_dtype: str  # what --kv-cache-dtype auto stores
    source: str  # the file it was read from

    def resolve(self, kv_cache_dtype: str) -> str:
        return self.model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype

    def bytes_per_token(self, kv_cache_dtype: str) -> int:
        kv_dtype = self.resolve(kv_cache_dtype)
        row_values = self.head_dim + (INT8_SCALE_BYTES if kv_dtype == INT8 else 0)
        return 2 * self.num_layers * self.num_kv_heads * row_values * VALUE_BYTES[kv_dtype]


def _positive_int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShapeError(f"{source}: {key} is {value!r}; sizing the KV cache needs one positive "
                         "count for every layer")
    return value


def _config_shape(path: Path) -> KVShape:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ShapeError(f"cannot read {path}: {exc}") from None
    source = str(path)
    missing = [key for key in ("num_hidden_layers", "num_attention_heads", "hidden_size")
               if key not in raw]
    if missing:
        raise ShapeError(f"{source} has no {', '.join(missing)}; is it a decoder model's config?")
    num_heads = _positive_int(raw["num_attention_heads"], "num_attention_heads", source)
    head_dim = raw.get("head_dim") or _positive_int(raw["hidden_size"], "hidden_size",
                                                    source) // num_heads
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return KVShape(
        num_layers=_positive_int(raw["num_hidden_layers"], "num_hidden_layers", source),
        num_kv_heads=_positive_int(raw.get("num_key_value_heads") or num_heads,
                                   "num_key_value_heads", source),
        head_dim=_positive_int(head_dim, "head_dim", source),
        model_dtype=dtype if dtype in VALUE_BYTES and dtype != INT8 else DEFAULT_MODEL_DTYPE,
        source=source)


def _gguf_shape(path: Path) -> KVShape:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ShapeError(f"cannot read {path} as a GGUF file: {exc}") from None

    def get(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    source = str(path)
    architecture = get("general.architecture")
    if not architecture:
        raise ShapeError(f"{source} has no general.architecture metadata; is it a complete GGUF?")

    def count(key: str, default: int | None = None) -> int:
        value = get(f"{architecture}.{key}")
        if value is None and default is None:
            raise ShapeError(f"{source} has no {architecture}.{key} metadata")
        return _positive_int(default if value is None else value, f"{architecture}.{key}", source)

    num_heads = count("attention.head_count")
    return KVShape(
        num_layers=count("block_count"),
        num_kv_heads=count("attention.head_count_kv", num_heads),
        head_dim=count("attention.key_length", count("embedding_length") // num_heads),
        model_dtype=DEFAULT_MODEL_DTYPE, source=source)


def model_file(path: str | Path) -> Path:
    """The file that describes a model: a checkpoint directory's config.json, a .gguf file, or
    the one .gguf of a directory with no config.json (as ``--model`` takes them)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir():
        raise ShapeError(f"{path} is neither a checkpoint directory nor a .gguf file")
    if (path / "config.json").is_file():
        return path / "config.json"
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        what = "no config.json and no .gguf file" if not found else "several .gguf files"
        raise ShapeError(f"{path} holds {what}; pass a checkpoint directory or one FILE.gguf")
    return found[0]


def read_shape(path: str | Path) -> KVShape:
    """The KV shape of a Hugging Face checkpoint directory, a .gguf file, or a directory holding
    one .gguf and no config.json."""
    found = model_file(path)
    return _gguf_shape(found) if found.suffix == ".gguf" else _config_shape(found)


@dataclass(frozen=True)
class KVBytes:
    """Bytes per cached token of the replayed cache: from a model's shape and a KV dtype, or
    given outright (then the shape and dtype are unknown)."""

    bytes_per_token: int
    kv_dtype: str | None = None  # resolved: never "auto"
    shape: KVShape | None = None

    @classmethod
    def of_model(cls, shape: KVShape, kv_cache_dtype: str) -> KVBytes:
        return cls(shape.bytes_per_token(kv_cache_dtype), shape.resolve(kv_cache_dtype), shape)

    def pages(self, gib: float, page_size: int) -> int:
        """Whole pages in ``gib`` GiB, rounded down as the engine's ``--kv-cache-gb`` is."""
        return int(gib * GIB) // (self.bytes_per_token * page_size)

    def compared(self) -> dict[str, int]:
        """Bytes per token of the model's own dtype and of int8, for the sweep's 8-bit view
        (empty without a shape)."""
        if self.shape is None:
            return {}
        return {dtype: self.shape.bytes_per_token(dtype)
                for dtype in dict.fromkeys((self.shape.model_dtype, INT8))}

    def describe(self) -> str:
        if self.shape is None:
            return f"{self.bytes_per_token:,} bytes a token (given)"
        s = self.shape
        row = (f"({s.head_dim} + {INT8_SCALE_BYTES})" if self.kv_dtype == INT8
               else f"{s.head_dim} x {VALUE_BYTES[self.kv_dtype]}")
        return (f"{self.kv_dtype}, {self.bytes_per_token:,} bytes a token = 2 x {s.num_layers} "
                f"layers x {s.num_kv_heads} KV heads x {row} bytes ({s.source})")

    def to_json(self) -> dict[str, Any]:
        shape = {} if self.shape is None else asdict(self.shape)
        return {"bytes_per_token": self.bytes_per_token, "kv_dtype": self.kv_dtype, **shape,
                "compared_bytes_per_token": self.compared(), "description": self.describe()}


def format_bytes(value: int | None) -> str:
    """``value`` in the largest binary unit that keeps it at least 1: 1.13 GiB, 576.0 KiB."""
    if value is None:
        return "-"
    for unit, scale, digits in (("TiB", 1 << 40, 2), ("GiB", GIB, 2), ("MiB", 1 << 20, 1),
                                ("KiB", 1 << 10, 1)):
        if value >= scale:
            return f"{value / scale:,.{digits}f} {unit}"
    return f"{value:,} B"
