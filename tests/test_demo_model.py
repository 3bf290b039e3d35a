"""The demo checkpoint: deterministic, atomic, and an ordinary HF checkpoint to transformers."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoints.demo_model import (
    ENDOFTEXT,
    IM_END,
    MODEL_FILES,
    build_demo_model,
    default_cache_dir,
    main,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("cache"))


def file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_key_gives_same_bytes(model_dir: Path, tmp_path: Path) -> None:
    again = build_demo_model(tmp_path)
    assert again.name == model_dir.name
    assert sorted(p.name for p in again.iterdir()) == sorted(MODEL_FILES)
    assert file_hashes(again) == file_hashes(model_dir)


def test_existing_model_is_reused_and_a_damaged_one_rebuilt(model_dir: Path,
                                                          tmp_path: Path) -> None:
    first = tmp_path / model_dir.name  # a cache that holds the model already
    shutil.copytree(model_dir, first)
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_demo_model(tmp_path) == first
    assert weights.stat().st_mtime_ns == stamp

    expected = file_hashes(first)
    (first / "tokenizer.json").unlink()
    assert build_demo_model(tmp_path) == first
    assert file_hashes(first) == expected
    # no temp dirs left behind: only the builders' lock file beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{first.name}.lock", first.name]


@pytest.mark.e2e
def test_concurrent_builders_agree_and_leave_no_temp_dirs(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "engine.checkpoints.demo_model", "--out", str(tmp_path)]
    procs = [
        subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], [err for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    built = Path(paths.pop())
    # beside it only the builders' lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{built.name}.lock", built.name]
    assert sorted(p.name for p in built.iterdir()) == sorted(MODEL_FILES)


def test_concurrent_builders_take_turns_and_build_once(tmp_path: Path) -> None:
    """Builders of one artefact at once: the first builds, the others wait for its turn to end
    and find its result."""
    import threading
    import time

    from engine.checkpoints.artifact_cache import build_once

    writes = []

    def write(staging: Path) -> None:
        writes.append(staging)
        time.sleep(0.3)
        (staging / "artefact").write_text("built")

    results = []
    threads = [threading.Thread(target=lambda: results.append(
        build_once(tmp_path / "thing", write, ["artefact"]))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [tmp_path / "thing"] * 3
    assert len(writes) == 1
    assert (tmp_path / "thing" / "artefact").read_text() == "built"


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("RADIXSERVE_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "radixserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "radixserve"


def test_cli_prints_the_path(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--out", str(model_dir.parent)])
    assert capsys.readouterr().out.strip() == str(model_dir)


def test_config_is_a_small_gqa_llama(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_attention_heads"] == 8 and config["num_key_value_heads"] == 4
    assert config["head_dim"] * config["num_attention_heads"] == 256 == config["hidden_size"]
    assert config["tie_word_embeddings"] is False
    assert config["vocab_size"] % 64 == 0


def test_transformers_loads_and_runs_it(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size >= len(tokenizer)
    rope = getattr(model.config, "rope_parameters", None) or {"rope_theta": model.config.rope_theta}
    assert rope["rope_theta"] == 10000.0
    ids = torch.tensor([tokenizer.encode("def main():\n    return 0")])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert logits.shape == (ids.shape[1], model.config.vocab_size)
    # Greedy parity needs clear winners: the top-2 gap is far above fp32 noise at most steps.
    top2 = logits.topk(2).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > 0.1


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!  Two  spaces, a tab\tand\na newline.",
        "def f(x):\n    return x ** 2  # square\n",
        "naïve café 漢字 🙂",
        "Ünïcödé — «quotes» 日本語のテキスト 😀👍🏽",
        "",
    ],
)
def test_tokenizer_round_trips_text(model_dir: Path, text: str) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(i not in tokenizer.all_special_ids for i in ids)  # no BOS/EOS added silently


def test_chat_template_renders_chatml(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "More?"}]},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nMore?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert closed.endswith("More?<|im_end|>\n")
    ids = tokenizer.encode(prompt)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == prompt


def test_eos_ids_are_the_special_tokens(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    generation = transformers.GenerationConfig.from_pretrained(model_dir)
    assert tokenizer.convert_ids_to_tokens(generation.eos_token_id) == [IM_END, ENDOFTEXT]
    assert set(generation.eos_token_id) <= set(tokenizer.all_special_ids)
    assert tokenizer.eos_token == ENDOFTEXT and tokenizer.pad_token == ENDOFTEXT
    for token in (IM_END, ENDOFTEXT):
        assert len(tokenizer.encode(token)) == 1  # a special token is never split
    assert tokenizer.decode(tokenizer.encode(f"hi{IM_END}"), skip_special_tokens=True) == "hi"
