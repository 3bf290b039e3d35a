"""Every supported architecture in plain torch (llama.py), each a small description
(architecture.py) in its config (config.py: no torch), RoPE (rope.py), checkpoint loading
(loader.py) and tensor-parallel sharding (parallel.py)."""
