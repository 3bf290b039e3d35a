"""docs/api.md against the code: every request field, response field, route, status,
environment variable and command-line flag has its line there (and the profiler's flags in
docs/profiler.md), so adding one without documenting it fails here."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import msgspec
import pytest

from engine.cli import build_parser
from engine.contracts.engine_config import EngineConfig
from engine.contracts.options import declared_options
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.structured import StructuredOutputs
from engine.server import anthropic_schemas, responses_schemas, schemas
from engine.server.app import build_app
from engine.server.errors import ERROR_TYPES
from engine.server.options import ServeOptions
from engine.server.service import Service
from tests.test_server_app import INFO, ScriptedClient

ROOT = Path(__file__).resolve().parent.parent
API = (ROOT / "docs" / "api.md").read_text()
PROFILER = (ROOT / "docs" / "profiler.md").read_text()
SOURCES = ("engine", "radix", "scheduler", "tokenizer_worker")


def section(title: str, text: str = API) -> str:
    """The text under the heading ``title`` up to the next heading of its level or above."""
    match = re.search(rf"^(#+) {re.escape(title)}\n", text, re.M)
    assert match, f"docs/api.md has no section {title!r}"
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def undocumented(names: list[str], text: str) -> list[str]:
    """The names that ``text`` never opens a code span with (`--flag` or `--flag VALUE`)."""
    return [name for name in names if not re.search(rf"`{re.escape(name)}(?![\w-])", text)]


def fields(struct: type[msgspec.Struct], *, without: type[msgspec.Struct] | None = None
           ) -> list[str]:
    inherited = set(without.__struct_fields__) if without else set()
    return [name for name in struct.__struct_fields__ if name not in inherited]


@pytest.mark.parametrize(("title", "names"), [
    ("Completions and chat: shared fields", fields(schemas.SamplingFields)),
    ("Completions and chat: shared fields",
     fields(schemas.ResponseFormat) + fields(schemas.JsonSchemaFormat)
     + fields(schemas.StreamOptions) + fields(StructuredOutputs)),
    ("/v1/completions", fields(schemas.CompletionRequest, without=schemas.SamplingFields)),
    ("/v1/chat/completions",
     fields(schemas.ChatCompletionRequest, without=schemas.SamplingFields)
     + fields(schemas.FunctionDefinition) + fields(schemas.ChatTool)),
    ("/generate", fields(schemas.GenerateBody) + fields(SamplingParams)),
    ("/v1/sessions", fields(schemas.SessionBody)),
    ("/tokenize and /detokenize", fields(schemas.TokenizeBody) + fields(schemas.DetokenizeBody)),
    ("/v1/messages and /v1/messages/count_tokens",
     [name for struct in (anthropic_schemas.MessagesRequest, anthropic_schemas.InputMessage,
                          anthropic_schemas.TextBlock, anthropic_schemas.ToolUseBlock,
                          anthropic_schemas.ToolResultBlock, anthropic_schemas.Tool,
                          anthropic_schemas.ToolChoiceTool, anthropic_schemas.ToolChoiceAuto)
      for name in fields(struct)]),
    ("/v1/responses",
     [name for struct in (responses_schemas.ResponsesRequest, responses_schemas.FunctionTool,
                          responses_schemas.TextFormat, responses_schemas.MessageItem,
                          responses_schemas.ContentPart, responses_schemas.FunctionCallItem,
                          responses_schemas.FunctionCallOutputItem)
      for name in fields(struct)]),
])
def test_every_request_field_has_a_line(title: str, names: list[str]) -> None:
    assert undocumented(names, section(title)) == []


def test_every_response_field_has_a_line() -> None:
    responses = [value for module in (schemas, anthropic_schemas, responses_schemas)
                 for value in vars(module).values()
                 if isinstance(value, type) and issubclass(value, msgspec.Struct)
                 and not issubclass(value, schemas._Body)]
    names = sorted({name for struct in responses for name in struct.__struct_fields__})
    assert len(names) > 40
    assert undocumented(names, section("Responses")) == []


def test_every_route_has_a_line() -> None:
    from engine.contracts.engine_config import EngineConfig as Config

    app = build_app(Service(ScriptedClient(), INFO, Config(model="/models/tiny")))
    routes = [f"{method} {route.path}" for route in app.routes
              for method in sorted(route.methods - {"HEAD"})]
    assert len(routes) >= 9
    assert undocumented(routes, section("Endpoints")) == []


def test_every_status_has_a_line() -> None:
    statuses = section("Statuses")
    # 499: a client gone before its answer (engine/server/app.py), outside the error table
    missing = [code for code in (*ERROR_TYPES, 200, 499) if f"| {code} |" not in statuses]
    assert missing == []


def _environment_variables() -> set[str]:
    """Names read from os.environ anywhere in the engine (a literal or a module constant),
    plus the variables declared options take their defaults from."""
    found = {option.env for struct in (EngineConfig, ServeOptions)
             for option in declared_options(struct) if option.env}
    for package in SOURCES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            constants = {target.id: node.value.value for node in tree.body
                         if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                         and isinstance(node.value.value, str)
                         for target in node.targets if isinstance(target, ast.Name)}
            for node in ast.walk(tree):
                key = None
                if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                        "os.environ.get", "os.getenv") and node.args:
                    key = node.args[0]
                elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                    key = node.slice
                elif isinstance(node, ast.Compare) and any(
                        ast.unparse(c) == "os.environ" for c in node.comparators):
                    key = node.left
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    found.add(key.value)
                elif isinstance(key, ast.Name) and key.id in constants:
                    found.add(constants[key.id])
    return found


def test_every_environment_variable_has_a_line() -> None:
    names = sorted(_environment_variables())
    assert {"RADIXSERVE_API_KEY", "RADIXSERVE_CACHE", "RADIXSERVE_CPU_KERNELS"} <= set(names)
    assert undocumented(names, section("Environment variables")) == []


def _flags(command: str) -> list[str]:
    subparsers = next(action for action in build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction))
    parser = subparsers.choices[command]
    return [flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"]


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "bench"])
def test_every_flag_of_a_command_has_a_line(command: str) -> None:
    text = section(f"radixserve {command}")
    if command in ("generate", "bench"):  # their engine flags are serve's table
        text += section("radixserve serve")
    names = _flags(command)
    assert len(names) >= 3
    assert undocumented(names, text) == []


def test_the_profilers_flags_have_a_line_in_its_doc() -> None:
    assert undocumented(_flags("profile"), PROFILER) == []


def test_a_field_added_without_a_line_is_caught() -> None:
    class Grown(schemas.SamplingFields, kw_only=True):
        brand_new_field: int = 0

    assert undocumented(fields(Grown), section("Completions and chat: shared fields")) == [
        "brand_new_field"]
