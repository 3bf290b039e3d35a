"""Fixtures for the modules that start a server: a module whose ``server`` fixture is a
ServerProcess started with ``--api-key API_KEY`` gets ``oai``, the official openai client on it,
and ``model``, the id of the model it serves. ``harness_model_dir``: the checkpoint the
in-process scheduler tests run."""

from __future__ import annotations

import pytest

from tests.server_process import API_KEY


@pytest.fixture(scope="module")
def oai(server):
    import openai  # here rather than above: every session would pay its half-second import

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


@pytest.fixture(scope="session")
def harness_model_dir(tmp_path_factory) -> str:
    """The model of the in-process scheduler tests (the speculation ones keep the demo model:
    their drafting follows measured step times): a random Llama with the demo model's
    vocabulary (4,096 ids, from which their prompts draw) and context, the width and depth of
    tests/conftest_models.py (a step costs a third of the demo model's) and an LM head whose
    logits spread like the demo model's (top-2 margins over 20 random prompts: median 0.6
    nats, 0.8 for the demo model). Written once per session."""
    from tests.conftest_models import write_checkpoint  # imports transformers: only when used

    path = tmp_path_factory.mktemp("harness_model")
    return str(write_checkpoint(path, "llama", head_std=0.5, vocab_size=4096,
                                max_position_embeddings=4096))


@pytest.fixture(scope="session")
def default_model(tmp_path_factory) -> str:
    """A model that takes the default model's path: a GGUF whose projections, embedding and LM
    head are Q4_1 blocks (SmolLM2-135M-Instruct's file holds Q4_1), served by the compiled
    kernels under ``--quantization auto`` in the machine's default dtype, with a ChatML template
    and a 4,096-token context. Tiny (2 layers, hidden 64, a byte-level vocabulary), so servers
    start in seconds. Written once per session."""
    from gguf import GGMLQuantizationType

    from tests.test_gguf import write_gguf  # imports the gguf package: only when used

    path = tmp_path_factory.mktemp("default_model") / "tiny-q4_1.gguf"
    return str(write_gguf(path, GGMLQuantizationType.Q4_1, context=4096))
