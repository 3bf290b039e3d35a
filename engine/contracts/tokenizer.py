"""The model's tokenizer, loaded the one way every process that needs it does (the tokenizer
workers; the model worker, for the grammar engine's view of the vocabulary), and the chat
template ``--chat-template`` puts in place of the model's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str, chat_template: str | None = None) -> Any:
    """The model's tokenizer, with ``chat_template`` (``--chat-template``: a Jinja file or the
    template's text) as its chat template when given. A ``tokenizer.json`` loads as the fast
    tokenizer directly, the class transformers' AutoTokenizer picks for it too, without
    importing torch (AutoTokenizer does: about 6 s of CPU on every start); other layouts go
    through AutoTokenizer."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """``--chat-template``'s template: the file ``value`` names, else ``value`` itself; a
    sentence when it is neither a file nor Jinja, or does not parse."""
    import jinja2

    path = Path(value)
    if path.is_file():
        text = path.read_text()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template "
                         "(template text has {{ ... }} or {% ... %})")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"--chat-template does not parse as Jinja: line {error.lineno}: "
                         f"{error.message}") from error
    return text
