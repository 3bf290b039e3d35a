"""scripts/gpu_phase.py on CPU: the dry run walks every step of both phases in order with
budgets inside the phase's and writes nothing, budgets scale, the wheels step is skipped
without wheels, and a step past its budget is killed with what it printed kept in
the phase's JSON summary."""

from __future__ import annotations

import json
import sys

import pytest

from scripts import gpu_phase


@pytest.mark.parametrize("phase", [1, 2])
def test_dry_run_walks_every_step_in_order_and_writes_nothing(phase: int, tmp_path,
                                                              capsys) -> None:
    out = tmp_path / "out"
    assert gpu_phase.main([str(phase), "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    steps = gpu_phase.phase_steps(phase, out)
    total = sum(step.budget_s for step in steps)
    assert total <= gpu_phase.PHASE_BUDGET_S <= 480
    assert f"budgets adding to {total} of {gpu_phase.PHASE_BUDGET_S} s" in printed
    positions = [printed.index(f"=== {i}/{len(steps)} {step.name}")
                 for i, step in enumerate(steps, 1)]
    assert positions == sorted(positions)
    assert printed.count(": dry run") == len(steps)
    assert not out.exists()


def test_budget_scale_stretches_every_budget(tmp_path, capsys) -> None:
    steps = gpu_phase.phase_steps(1, tmp_path)
    assert gpu_phase.main(["1", "--dry-run", "--budget-scale", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"budgets adding to {sum(3 * s.budget_s for s in steps)} of " \
           f"{3 * gpu_phase.PHASE_BUDGET_S} s" in printed
    assert f"{3 * steps[2].budget_s:>3} s  {steps[2].name}" in printed
    with pytest.raises(SystemExit):
        gpu_phase.main(["1", "--dry-run", "--budget-scale", "0"])


def test_without_wheels_the_installed_packages_are_used(tmp_path, monkeypatch) -> None:
    """A GPU machine with network installs FlashInfer with pip install -e '.[gpu]': the
    install step is skipped when ./wheels holds none, and the phase goes on."""
    monkeypatch.setattr(gpu_phase, "REPO", tmp_path)
    install = gpu_phase.install_wheels()
    assert install.skip_if == tmp_path and not any(a.endswith(".whl") for a in install.argv)
    ran = []
    monkeypatch.setattr(gpu_phase, "phase_steps", lambda phase, out: [
        install, gpu_phase.Step("next", 10, (sys.executable, "-c", "print('ran')"))])
    monkeypatch.setattr(gpu_phase.Phase, "execute",
                        lambda self, step: ran.append(step.name) or {"status": "ok"})
    assert gpu_phase.main(["1", "--out", str(tmp_path / "out")]) == 0
    assert ran == ["next"]
    summary = json.loads((tmp_path / "out" / "phase1.json").read_text())
    assert summary["steps"][0]["status"].startswith("skipped: wheels/ holds none")


@pytest.mark.e2e
def test_a_step_past_its_budget_is_killed_and_its_output_kept(tmp_path, monkeypatch) -> None:
    steps = [
        gpu_phase.Step("measures, then hangs", 2,
                       (sys.executable, "-c", "import time\nprint('measured 42', flush=True)\n"
                                              "time.sleep(60)")),
        gpu_phase.Step("fails", 10, (sys.executable, "-c", "raise SystemExit(3)")),
        gpu_phase.Step("optional, hangs", 1, (sys.executable, "-c", "import time\n"
                                                                    "time.sleep(60)"),
                       optional=True),
    ]
    monkeypatch.setattr(gpu_phase, "phase_steps", lambda phase, out: steps)
    assert gpu_phase.main(["1", "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "phase1.json").read_text())
    hung, failed, optional = summary["steps"]
    assert hung["status"] == "out of budget" and hung["tail"] == ["measured 42"]
    assert hung["seconds"] < 10
    assert (failed["status"], failed["rc"]) == ("failed", 3)
    assert optional["status"] == "out of budget"
    assert summary["status"] == "FAILED"
    assert "measured 42" in (tmp_path / "phase1.log").read_text()


def test_phase_1_builds_the_fp8_modules_phase_2_loads(monkeypatch) -> None:
    """The FA2 prebuild names the mixed-precision modules (bf16 queries over fp8 KV, both
    formats) that gpu_check's fp8 part loads; FA3 has none (fp8 KV runs on FA2)."""
    from scripts import gpu_kernels
    from tests import fake_flashinfer

    module = fake_flashinfer.module()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.jit", module.jit)
    fa2 = [spec.name for spec in gpu_kernels.kernel_specs("fa2")]
    for kv in ("float8_e4m3fn", "float8_e5m2"):
        fp8 = [name for name in fa2 if f"bfloat16_{kv}_bfloat16_int32_128_128" in name]
        # both shapes (32/8, 16/4) decode on tensor cores: one prefill module serves both
        assert fp8 == [f"prefill_fa2_bfloat16_{kv}_bfloat16_int32_128_128_0_False_False_False"]
    assert not any("float8" in spec.name for spec in gpu_kernels.kernel_specs("fa3"))
