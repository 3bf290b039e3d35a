"""scripts/mutants.py's list, without running it (``make mutants`` does): every mutant's
snippet is found exactly once in its file and changes it into code that still parses (a mutant
that breaks the syntax tests nothing), its name is its own, and the tests it names exist and
are fast ones, so that code moving on shows here first."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
mutants = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mutants  # dataclasses look their module up there
_spec.loader.exec_module(mutants)


def test_every_mutant_changes_one_place_and_names_fast_tests_that_exist():
    names = [m.name for m in mutants.MUTANTS]
    assert len(set(names)) == len(names)
    for m in mutants.MUTANTS:
        text = (ROOT / m.path).read_text()
        assert text.count(m.original) == 1, f"{m.name}: its snippet is not in {m.path} once"
        assert m.replacement != m.original and m.tests and m.invariant, m.name
        if m.path.endswith(".py"):
            ast.parse(text.replace(m.original, m.replacement), m.path)  # SyntaxError: it names the line
        for test in m.tests:
            file, _, function = test.partition("::")
            source = (ROOT / file).read_text()
            assert not slow(source, function), f"{m.name}: {test} is not a fast test"


def slow(source: str, function: str) -> bool:
    """Whether test ``function`` of a module's ``source`` (the whole module when empty) is
    marked e2e or slow; AssertionError when it does not exist."""
    marked = re.compile(r"mark\.(e2e|slow)\b")
    module = re.search(r"^pytestmark = .*", source, re.MULTILINE)
    if module and marked.search(module.group()):
        return True
    if not function:
        return False
    name = function.partition("::")[0]  # a test class's method: the class
    at = max(source.find(f"\n{how}") for how in (f"def {name}(", f"class {name}", f"{name} = "))
    assert at >= 0, f"no test {function}"
    decorators = source[source.rfind("\n\n", 0, at) : at]  # the lines since the blank one
    return bool(marked.search(decorators))


def test_a_slow_or_missing_test_is_told_apart():
    source = (ROOT / "tests" / "test_tenant_isolation.py").read_text()
    assert slow(source, "test_different_salts_never_share_cache")  # e2e, then parametrized
    assert not slow(source, "test_metrics_open_serves_them_without_the_key")
    assert slow((ROOT / "tests" / "test_zmq_frontend.py").read_text(), "")
    assert not slow((ROOT / "tests" / "test_sliding_properties.py").read_text(),
                    "TestSlidingRadixMachine::runTest")  # a hypothesis machine's test case
