"""Compiled CPU kernels (engine/worker/csrc/), built on first use and cached.

- ``paged_decode_op()``: ``torch.ops.radixserve.paged_decode``, decode attention that reads each
  sequence's keys and values straight from its pages, where the torch path first gathers them
  into a dense copy per layer and step (csrc/paged_decode.cpp says how);
- ``extend_attention_op()``: ``torch.ops.radixserve.extend_attention``, the same for the many
  query rows of an extend or prefill in bf16, its two products on oneDNN's brgemm micro-kernel
  (AMX tiles where the CPU has them; csrc/extend_attention.cpp);
- ``rms_norm_op()``: ``torch.ops.radixserve.rms_norm``, RMSNorm of rows in one op where torch
  takes four to six (csrc/rms_norm.cpp); ``add_rms_norm_op()``: a projection's rows added into
  the float32 residual stream and the sum normalised, in one op;
- ``silu_mul_op()``: ``torch.ops.radixserve.silu_mul``, SiLU(gate) * up of a gated MLP in one
  pass (csrc/silu_mul.cpp);
- ``rope_store_op()``: ``torch.ops.radixserve.rope_store``, the rotary embedding of a step's
  queries and keys and the store of its keys and values into the pool, in one op
  (csrc/rope_store.cpp).
- ``quant_ops()``: ``torch.ops.radixserve.quant_linear`` and ``dequantize_weight``, linear
  layers over quantized weight blocks (csrc/quant_linear.cpp; their layout, csrc/quant_layout.h,
  written by csrc/quant_repack.cpp, which also holds dequantize_weight).
- ``lora_bgmv_op()``: ``torch.ops.radixserve.lora_bgmv``, every row's LoRA update under its own
  adapter in one op, where the torch path takes a pair of matmuls per adapter
  (csrc/lora_bgmv.cpp).

They are built together, once per machine, torch version and source (``-march=native``: the
build is for this CPU), as one translation unit (torch's headers take most of a file's compile
time: parsed once, the build takes about a third of the CPU time of one unit per file), with
the C++ compiler torch's extensions use, into the radixserve cache;
a second start only loads them. Without a compiler, or with ``RADIXSERVE_CPU_KERNELS=0``, they
are None and the torch code paths serve every step (quantized weights are then widened to the
model's dtype at load); the log says which and why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from engine.checkpoints.artifact_cache import build_once, default_cache_dir

logger = logging.getLogger("radixserve.attention")

CSRC = Path(__file__).parent / "csrc"
ENV_SWITCH = "RADIXSERVE_CPU_KERNELS"
_NAME = "radixserve_cpu_kernels"
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
# -fopenmp links libgomp.so.1; torch ships and loads its own under that name, so the kernel's
# parallel loops run on torch's OpenMP threads (torch.set_num_threads governs both).
_LDFLAGS = ("-fopenmp",)
# The engine loads "native"; the tests load the others beside it (ops_namespace) to check the
# loops other CPUs take: "avx2", the 8-wide loops of CPUs with AVX2, FMA and F16C but no AVX-512
# (-march=native less AVX-512, so that a CPU with it runs them too), and "portable", the plain
# C++ ones of CPUs with neither.
VARIANTS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-DRADIXSERVE_PORTABLE",)}
_BUILD_SCRIPT = """
import sys
from torch.utils.cpp_extension import load
name, sources, build_dir = sys.argv[1:4]
load(name=name, sources=sources.split(","), build_directory=build_dir, is_python_module=False,
     extra_cflags=sys.argv[4].split(), extra_ldflags=sys.argv[5].split())
"""


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def ops_namespace(variant: str) -> str:
    """Where a build's ops register: ``torch.ops.<this>``."""
    return "radixserve" if variant == "native" else f"radixserve_{variant}"


def build(variant: str = "native") -> Path:
    """The compiled kernels' shared library, built unless the cache holds it already.
    ``variant``: one of ``VARIANTS``, the engine's build unless a test asks for another."""
    sources = sorted(CSRC.glob("*.cpp"))
    texts = [path.read_text() for path in sorted(CSRC.iterdir()) if path.suffix in (".cpp", ".h")]
    name = _NAME if variant == "native" else f"{_NAME}_{variant}"
    cflags = [*_CFLAGS, *VARIANTS[variant], f"-DRADIXSERVE_OPS_NAMESPACE={ops_namespace(variant)}"]
    key = hashlib.sha256(
        "\0".join([*texts, torch.__version__, " ".join(cflags), _cpu_id(), sys.version]).encode()
    ).hexdigest()[:16]

    def write(staging: Path) -> None:
        logger.info("compiling the CPU kernels for this machine (once; cached in %s)",
                    staging.parent)
        # A child process builds, so that a failed or crashed compile cannot take this one
        # down, and nothing is loaded from a directory that is about to be renamed.
        # torch looks for ninja on PATH: the one pip installed beside this Python comes first.
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        unit = staging / f"{name}.cpp"
        unit.write_text("".join(f'#include "{path}"\n' for path in sources))
        done = subprocess.run(
            [sys.executable, "-c", _BUILD_SCRIPT, name, str(unit), str(staging),
             " ".join(cflags), " ".join(_LDFLAGS)],
            capture_output=True, text=True, timeout=600, env=env,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
            raise RuntimeError("compiling the CPU kernels failed:\n" + "\n".join(tail))

    directory = build_once(default_cache_dir() / "cpu-kernels" / f"{name}-{key}", write,
                           [f"{name}.so"])
    return directory / f"{name}.so"


@functools.cache
def _ops() -> object | None:
    """``torch.ops.radixserve`` once its library is loaded, or None (logged)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("compiled CPU kernels off (%s=0): decode gathers pages for torch's SDPA "
                    "and RMSNorm runs as torch ops", ENV_SWITCH)
        return None
    try:
        torch.ops.load_library(str(build()))
    except Exception as exc:  # no compiler, no headers, a failed build: the torch path serves
        logger.warning("compiled CPU kernels unavailable (%s: %s); decode gathers pages for "
                       "torch's SDPA and RMSNorm runs as torch ops instead",
                       type(exc).__name__, exc)
        return None
    return torch.ops.radixserve


@functools.cache
def paged_decode_op(quantized: bool = False) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """None also where the build has no vectorised loops (neither AVX-512 nor AVX2 with FMA
    and F16C): there the plain C++ kernel measured no faster than gathering pages for torch's
    SDPA (653 vs 664 us, 908 vs 802 us at batch 8 and 608-token contexts, against 361 / 512 us
    with AVX-512). ``quantized`` (an int8 pool): the kernel wherever it is built, since the
    torch path would dequantize each sequence's pages into a full-precision copy first."""
    ops = _ops()
    if ops is None:
        return None
    if not quantized and not ops.paged_decode_vectorized():
        logger.info("decode attention gathers pages for torch's SDPA: this CPU has neither "
                    "AVX-512 nor AVX2 with FMA and F16C for the compiled kernel")
        return None
    return ops.paged_decode


@functools.cache
def extend_attention_op() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """None also where the build lacks AVX-512 with BF16 or torch's oneDNN offers no bf16
    brgemm on this CPU (neither AMX nor AVX-512 BF16): extends then gather pages for SDPA."""
    ops = _ops()
    if ops is None:
        return None
    if not ops.extend_attention_available():
        logger.info("bf16 extends gather pages for torch's SDPA: this CPU or build has no bf16 "
                    "brgemm for the compiled extend kernel")
        return None
    return ops.extend_attention


def quant_ops() -> object | None:
    """The ops that read quantized weight blocks (``quant_linear``, ``dequantize_weight``,
    ``quant_linear_isa``: which loops this build has), or None without the compiled kernels."""
    return _ops()


def rms_norm_op() -> Callable[..., torch.Tensor] | None:
    ops = _ops()
    return None if ops is None else ops.rms_norm


def add_rms_norm_op() -> Callable[..., torch.Tensor] | None:
    ops = _ops()
    return None if ops is None else ops.add_rms_norm


@functools.cache
def silu_mul_op() -> Callable[..., torch.Tensor] | None:
    """None also where the build has no vectorised loops: its plain loop calls expf element by
    element, slower than torch's two vectorised ops."""
    ops = _ops()
    return None if ops is None or not ops.paged_decode_vectorized() else ops.silu_mul


def rope_store_op() -> Callable[..., torch.Tensor] | None:
    ops = _ops()
    return None if ops is None else ops.rope_store


def lora_bgmv_op() -> Callable[..., None] | None:
    ops = _ops()
    return None if ops is None else ops.lora_bgmv
