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
