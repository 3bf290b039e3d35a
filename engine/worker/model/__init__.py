"""The Llama family in plain torch (llama.py), its config (config.py: no torch) and checkpoint
loading (loader.py), with tensor-parallel sharding (parallel.py)."""
