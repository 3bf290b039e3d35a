"""The GPU check in two phases, each one device command well inside its 600 s limit.

    python3 scripts/gpu_phase.py 1              # wheels, then FlashInfer's kernels (FA2, FA3)
    python3 scripts/gpu_phase.py 2              # parity, graphs vs eager, benchmark, CUDA tests
    python3 scripts/gpu_phase.py 2 --dry-run    # print the steps and budgets; writes nothing

docs/gpu.md says how to run it. Phase 1 installs the wheels in ``./wheels`` (scripts/
gpu_wheels.sh, for a GPU machine without network; without them the installed packages are
used: ``pip install -e '.[gpu]'``) into ``.flashinfer-cache/site`` and builds FlashInfer's kernel modules into
``.flashinfer-cache`` (both ignored by git), FA2 first, then FA3 with the time that remains (the
engine takes FA3 only where its modules are built). Phase 2 runs from that cache, on the same
warm machine. Each step runs under its own budget (a hang cannot eat the phase), printed at the
top; the budgets of a phase add to at most ``PHASE_BUDGET_S`` (``--budget-scale`` stretches
every budget, for a machine whose build takes longer). The step's output goes to the
console and ``$OUT/phaseN.log``; ``$OUT/phaseN.json`` is rewritten after every step, so a phase
killed at its limit still leaves what it measured. Exit status 1 when a required step fails.

The CUDA tests run with ``RADIXSERVE_CPU_KERNELS=0``: building the compiled CPU kernels from
scratch does not fit their budget, and CI tests those kernels on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".flashinfer-cache"
SITE = CACHE / "site"
PHASE_BUDGET_S = 480  # each phase fits a 10-minute job with margin (at --budget-scale 1)
PYTHON = sys.executable

VERSIONS = """
import platform
from importlib.metadata import version

import flashinfer
import torch

from engine.worker.attention import resolve_backend
from scripts.gpu_kernels import kernel_specs

if not torch.cuda.is_available():
    raise SystemExit("the GPU check needs CUDA, and torch.cuda.is_available() is False")
capability = "".join(map(str, torch.cuda.get_device_capability()))
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA "
      f"{torch.version.cuda}), {torch.cuda.get_device_name()} (sm{capability}), flashinfer "
      f"{flashinfer.__version__}, apache-tvm-ffi {version('apache-tvm-ffi')}")
for head_dim in (64, 128, 32):
    print(f"attention backend auto, bfloat16, head_dim {head_dim}: "
          f"{resolve_backend('auto', torch.device('cuda'), torch.bfloat16, head_dim)}")
for family in ("fa2", "fa3"):
    specs = kernel_specs(family)
    print(f"{family}: {sum(s.is_compiled for s in specs)} of {len(specs)} modules built")
"""

FA2_BUILT = """
from scripts.gpu_kernels import kernel_specs

missing = [s.name for s in kernel_specs("fa2") if not s.is_compiled]
if missing:
    raise SystemExit(f"{len(missing)} FA2 modules are not in .flashinfer-cache (the machine "
                     "went back after phase 1?): run phase 1, then phase 2 at once")
print("FA2 modules: all built")
"""


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of a phase. ``optional``: running out of budget is not a failure (the FA3
    build continues next time from what it built). ``skip_if``: a path whose presence makes
    the step unnecessary."""

    name: str
    budget_s: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    optional: bool = False
    skip_if: Path | None = None


def install_wheels(skip_if: Path | None = None) -> Step:
    """Install ./wheels into .flashinfer-cache/site; skipped when there are none (the packages
    ``pip install -e '.[gpu]'`` installed are used)."""
    wheels = tuple(sorted(str(p) for p in (REPO / "wheels").glob("*.whl")))
    if not wheels:
        skip_if = REPO
    return Step("install ./wheels into .flashinfer-cache/site", 35,
                (PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                 "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels),
                skip_if=skip_if)


def phase_steps(phase: int, out: Path) -> list[Step]:
    gpu_check = str(REPO / "scripts" / "gpu_check.py")
    if phase == 1:
        return [
            install_wheels(),
            Step("versions and chosen backends", 20, (PYTHON, "-c", VERSIONS)),
            Step("FlashInfer FA2 kernels", 240,
                 (PYTHON, gpu_check, "--parts", "prebuild", "--kernels", "fa2")),
            Step("FlashInfer FA3 kernels (the time that remains)", 170,
                 (PYTHON, gpu_check, "--parts", "prebuild", "--kernels", "fa3"), optional=True),
        ]
    return [
        # Reinstalling would give FlashInfer's headers new times, and ninja would rebuild.
        install_wheels(skip_if=SITE / "flashinfer"),
        Step("versions, chosen backends, phase 1's kernels", 20,
             (PYTHON, "-c", VERSIONS + FA2_BUILT)),
        Step("attention parity, decode timings, the runner and its syncs", 90,
             (PYTHON, gpu_check, "--parts", "parity,decode,model")),
        Step("fp8 KV: parity, decode timings, the runner with CUDA graphs", 60,
             (PYTHON, gpu_check, "--parts", "fp8")),
        Step("prefix cache tiers: host and disk round trips", 25,
             (PYTHON, str(REPO / "scripts" / "check_tiers.py"))),
        Step("CUDA graphs vs eager", 85,
             (PYTHON, str(REPO / "scripts" / "check_cuda_graphs.py"), "--json",
              str(out / "graphs.json"))),
        Step("bench_gpu.py at Llama-3-8B's shapes, CUDA graphs", 85,
             (PYTHON, str(REPO / "scripts" / "bench_gpu.py"), "--enable-cuda-graph", "--json",
              str(out / "bench_gpu_graphs.json"))),
        Step("bench_gpu.py, eager decode", 50,
             (PYTHON, str(REPO / "scripts" / "bench_gpu.py"), "--skip-engine", "--json",
              str(out / "bench_gpu_eager.json"))),
        Step("tests/test_attention.py on CUDA (RADIXSERVE_CPU_KERNELS=0)", 30,
             (PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda",
              str(REPO / "tests" / "test_attention.py")),
             env=(("RADIXSERVE_CPU_KERNELS", "0"),)),
    ]


def step_env(step: Step) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", FLASHINFER_WORKSPACE_BASE=str(CACHE),
               MAX_JOBS=str(os.cpu_count() or 1))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), str(REPO),
                                                      env.get("PYTHONPATH")]))
    env.update(step.env)
    return env


class Phase:
    """Runs the steps, keeping ``phaseN.log`` and ``phaseN.json`` under ``out`` current."""

    def __init__(self, phase: int, out: Path, dry_run: bool, budget_scale: float = 1.0) -> None:
        self.phase, self.out, self.dry_run = phase, out, dry_run
        self.steps = [dataclasses.replace(s, budget_s=round(s.budget_s * budget_scale))
                      for s in phase_steps(phase, out)]
        self.phase_budget_s = round(PHASE_BUDGET_S * budget_scale)
        # a dry run writes nothing: it prints
        self.log: TextIO | None = None
        if not dry_run:
            out.mkdir(parents=True, exist_ok=True)
            self.log = open(out / f"phase{phase}.log", "a", encoding="utf-8")  # noqa: SIM115
        self.started = time.monotonic()
        self.results: list[dict[str, Any]] = [
            {"name": s.name, "budget_s": s.budget_s, "status": "not run"} for s in self.steps]

    def say(self, line: str) -> None:
        print(line, flush=True)
        if self.log is not None:
            self.log.write(line + "\n")
            self.log.flush()

    def write_summary(self, status: str) -> None:
        if self.dry_run:
            return
        summary = {"phase": self.phase, "budget_s": self.phase_budget_s,
                   "elapsed_s": round(time.monotonic() - self.started, 1), "status": status,
                   "steps": self.results}
        path = self.out / f"phase{self.phase}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(path)

    def run(self) -> bool:
        total = sum(s.budget_s for s in self.steps)
        if total > self.phase_budget_s:
            raise SystemExit(f"phase {self.phase}'s step budgets add to {total} s, over "
                             f"{self.phase_budget_s} s")
        self.say(f"# GPU check, phase {self.phase}{' (dry run)' if self.dry_run else ''}: "
                 f"{len(self.steps)} steps, budgets adding to {total} of "
                 f"{self.phase_budget_s} s")
        for i, step in enumerate(self.steps, 1):
            self.say(f"#   {i}. {step.budget_s:>3} s  {step.name}")
        self.write_summary("running")
        ok = True
        for i, step in enumerate(self.steps):
            self.say(f"\n=== {i + 1}/{len(self.steps)} {step.name} (budget {step.budget_s} s, "
                     f"at {time.monotonic() - self.started:.0f} s)")
            self.say("    " + " ".join(a if "\n" not in a else "<script>" for a in step.argv))
            result = self.results[i]
            if self.dry_run:
                missing = [a for a in step.argv if a.endswith(".py") and not Path(a).exists()]
                result["status"] = f"missing {missing}" if missing else "dry run"
                if step.skip_if == REPO:
                    result["status"] += "; wheels/ holds none: the installed packages are used"
                ok &= not missing
            elif step.skip_if == REPO:
                result["status"] = "skipped: wheels/ holds none, the installed packages are used"
            elif step.skip_if is not None and step.skip_if.exists():
                result["status"] = f"skipped: {step.skip_if.relative_to(REPO)} is there"
            else:
                result.update(self.execute(step))
                ok &= result["status"] == "ok" or step.optional
            self.say(f"=== {step.name}: {result['status']}")
            self.write_summary("running")
        status = "passed" if ok else "FAILED"
        self.write_summary(status)
        self.say(f"\nphase {self.phase}: {status} after {time.monotonic() - self.started:.0f} s")
        return ok

    def execute(self, step: Step) -> dict[str, Any]:
        """Run one step under its budget (its whole process group killed past it); its
        status, seconds, exit code and last lines."""
        start = time.monotonic()
        proc = subprocess.Popen(step.argv, cwd=REPO, env=step_env(step), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        tail: list[str] = []

        def copy_output() -> None:
            for line in proc.stdout:
                self.say(line.rstrip("\n"))
                tail.append(line.rstrip("\n"))
                del tail[:-30]

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=step.budget_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            status = "out of budget"
        reader.join(timeout=5)
        return {"status": status, "rc": rc, "seconds": round(time.monotonic() - start, 1),
                "tail": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", type=int, choices=(1, 2))
    parser.add_argument("--dry-run", action="store_true",
                        help="print the steps in order and their budgets; run and write nothing")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")),
                        help="where the log and the JSON summary go (default: $OUT, else out)")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiply every step's time budget, e.g. 3 where the kernel build "
                             "runs on few cores (default: 1)")
    args = parser.parse_args(argv)
    if args.budget_scale <= 0:
        parser.error("--budget-scale must be > 0")
    return 0 if Phase(args.phase, args.out.resolve(), args.dry_run,
                      args.budget_scale).run() else 1


if __name__ == "__main__":
    sys.exit(main())
