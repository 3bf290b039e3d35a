"""Every relative link in README.md and docs/*.md names a file of the repository and, with an
``#anchor``, one of that file's headings as GitHub slugs it: a heading renamed without its
links fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores
    dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: dict[str, int] = {}
    names = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            count = found.get(base, 0)
            names.add(base if count == 0 else f"{base}-{count}")
            found[base] = count + 1
    return names


def test_slugs_follow_github():
    assert slug("Quantized weights (scripts/bench_serving.py, scripts/weight_accuracy.py)") == \
        "quantized-weights-scriptsbench_servingpy-scriptsweight_accuracypy"
    assert slug("Served: the 1.5B file against llama.cpp, and `auto` against `none`") == \
        "served-the-15b-file-against-llamacpp-and-auto-against-none"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    assert broken == []
