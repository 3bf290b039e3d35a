"""--chat-template: a Jinja file or the template's text in place of the model's own chat
template, checked when the engine's options are; chat prompts then render with it."""

from __future__ import annotations

import pytest

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.tokenizer import load_tokenizer
from tokenizer_worker.template import render_chat, render_chat_text

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def demo() -> str:
    return str(build_demo_model())


@pytest.mark.parametrize("as_file", [True, False])
def test_the_template_replaces_the_models_own(demo, tmp_path, as_file):
    value = TEMPLATE
    if as_file:
        (tmp_path / "chat.jinja").write_text(TEMPLATE)
        value = str(tmp_path / "chat.jinja")
    EngineConfig(model=demo, chat_template=value).validate()
    tokenizer = load_tokenizer(demo, value)
    assert render_chat_text(tokenizer, MESSAGES) == "[user] hi\n[assistant] "
    assert render_chat(tokenizer, MESSAGES) == tokenizer.encode("[user] hi\n[assistant] ",
                                                                add_special_tokens=False)
    assert render_chat_text(load_tokenizer(demo), MESSAGES) != "[user] hi\n[assistant] "


def test_a_value_that_is_no_template_is_refused(demo, tmp_path):
    with pytest.raises(ValueError, match=r"--chat-template 'chat\.jinja' is neither a file nor "
                                         r"a Jinja template"):
        EngineConfig(model=demo, chat_template="chat.jinja").validate()
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m }}\n")
    with pytest.raises(ValueError, match=r"--chat-template does not parse as Jinja: line 1: .*endfor"):
        EngineConfig(model=demo, chat_template=str(tmp_path / "bad.jinja")).validate()
