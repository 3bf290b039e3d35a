"""Fixtures for the modules that start a server: a module whose ``server`` fixture is a
ServerProcess started with ``--api-key API_KEY`` gets ``oai``, the official openai client on it,
and ``model``, the id of the model it serves."""

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
