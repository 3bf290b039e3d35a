"""PEFT LoRA adapters of the demo model, made in code (random, non-zero B), and the
transformers + peft oracle that runs them."""

from __future__ import annotations

from pathlib import Path

import torch

# Two adapters of different ranks and target sets: A adapts attention (q, v, o), B adapts k and
# the MLP with rsLoRA's scale.
ADAPTERS = {
    "alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "beta": dict(r=8, lora_alpha=16, target_modules=["k_proj", "gate_proj", "up_proj",
                                                      "down_proj"], use_rslora=True),
}


def make_adapter(model_dir: str, out_dir: Path, seed: int, **settings) -> Path:
    """Save a PEFT adapter of the model at ``model_dir`` with random A and B (PEFT's default
    leaves B zero, which would change nothing) into ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def peft_model(model_dir: str, adapter_dir: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def make_adapters(model_dir: str, root: Path) -> dict[str, str]:
    """Every adapter of ``ADAPTERS`` for the model at ``model_dir``, saved under ``root``."""
    return {name: str(make_adapter(model_dir, root / name, seed, **settings))
            for seed, (name, settings) in enumerate(ADAPTERS.items())}


def oracle_models(model_dir: str, adapters: dict[str, str]) -> dict:
    """transformers + peft in fp32 under each adapter, and the base model under None."""
    from transformers import AutoModelForCausalLM

    models = {name: peft_model(model_dir, path) for name, path in adapters.items()}
    models[None] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return models
