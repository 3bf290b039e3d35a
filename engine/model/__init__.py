"""Model definitions and checkpoint loading for the GPU worker."""

from __future__ import annotations

from engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model, weight_files

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "load_model",
    "weight_files",
]
