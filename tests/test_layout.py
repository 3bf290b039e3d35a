"""The layout docs/design.md describes, read from the code's imports: each layer imports only
the layers below it, and no module imports itself back through others (no import circles).
Every import statement counts, also those inside functions and under TYPE_CHECKING."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "radix", "scheduler", "tokenizer_worker")

# layer -> the layers it may import (besides itself); most specific prefix wins
ALLOWED: dict[str, set[str]] = {
    "radix": set(),
    "engine.contracts": set(),
    "scheduler": {"radix", "engine.contracts"},
    "tokenizer_worker": {"engine.contracts"},
    "engine.checkpoints": {"engine.contracts"},
    "engine.worker": {"engine.checkpoints", "engine.contracts"},
    "engine.runtime": {"engine.worker", "engine.checkpoints", "engine.contracts", "scheduler",
                       "tokenizer_worker", "radix"},
    "engine.profiler": {"radix", "scheduler", "engine.checkpoints", "engine.contracts"},
    "engine.server": {"engine.runtime", "engine.contracts"},
    "engine.commands": {"engine.server", "engine.runtime", "engine.profiler", "engine.worker",
                        "engine.checkpoints", "engine.contracts", "scheduler", "radix",
                        "tokenizer_worker"},
}
TOP = {"engine", "engine.cli"}  # the package's front page and the CLI entry may import anything


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[module_name(path)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that ``name`` imports (``from pkg import mod`` names the module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    # "from engine.x import y" also names the packages above x, which import nothing here.
    return {t for t in found if not (known[t].name == "__init__.py" and t in name)}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Each module's imports; read once for the three checks below (not changed by them)."""
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer(name: str) -> str | None:
    best = None
    for prefix in ALLOWED:
        if (name == prefix or name.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best)):
            best = prefix
    return best


def test_every_module_has_a_layer() -> None:
    loose = [m for m in graph() if m not in TOP and layer(m) is None]
    assert not loose, f"modules outside the layers of docs/design.md: {loose}"


def test_layers_import_only_downward() -> None:
    upward = []
    for name, targets in graph().items():
        if name in TOP:
            continue
        own = layer(name)
        for target in targets:
            theirs = layer(target)
            if theirs != own and theirs not in ALLOWED[own]:
                upward.append(f"{name} -> {target}")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_import_circles() -> None:
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The reader itself: relative and absolute forms resolve to the module they name."""
    known = {"radix.a": tmp_path / "a.py", "radix.b": tmp_path / "b.py",
             "engine.server.x": tmp_path / "x.py"}
    known["radix.a"].write_text("from radix import b\n")
    known["radix.b"].write_text("def f():\n    from .a import g\n")
    known["engine.server.x"].write_text("import radix.a\n")
    assert imports_of("radix.a", known["radix.a"], known) == {"radix.b"}
    assert imports_of("radix.b", known["radix.b"], known) == {"radix.a"}
    assert "radix" not in ALLOWED[layer("engine.server.x")]
