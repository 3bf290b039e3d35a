"""A multi-turn chat session's conversation, held by the one tokenizer worker that owns it.

The history is token ids exactly as the model read and wrote them. A turn's prompt is
``history + fragment(new messages)``; a finished turn appends its generated ids as they came,
never re-tokenised, so every prompt extends the previous one token for token and the scheduler
finds the whole history cached.

The fragment is what the chat template writes after the last assistant reply, up to and
including the new generation prompt. It is found generically: render the conversation with a
sentinel as the last reply, followed by the new messages, and keep the text after the sentinel::

    ...<|im_start|>assistant\\nSENTINEL<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n
                                     └──────────────────────── fragment ─────────────────────────────┘

A reply that ended with the special token the template writes there (``<|im_end|>``) holds it
already, so it is dropped from the fragment; a reply cut by max_tokens gets it from the
fragment. A template that does not reproduce the sentinel verbatim exactly once cannot continue
a session and the turn is refused with a sentence saying so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from tokenizer_worker.template import JsonObjects, encode_rendered, render_chat, render_chat_spans

SENTINEL = "radixserve-session-reply-3f0d346b"


@dataclass
class ChatSession:
    token_ids: list[int] = field(default_factory=list)  # every turn's prompt and reply, as run
    messages: list[dict[str, Any]] = field(default_factory=list)  # replies as their text

    def prompt_for(self, tokenizer: PreTrainedTokenizerBase, new_messages: JsonObjects, *,
                   tools: JsonObjects | None = None, special_in_content: bool = False) -> list[int]:
        """Token ids of the next turn's prompt: the history, then the new messages' fragment
        (special tokens in message text are text, as in ``render_chat``)."""
        if not self.messages:
            return render_chat(tokenizer, new_messages, tools=tools,
                               special_in_content=special_in_content)
        conversation = [*self.messages[:-1], {"role": "assistant", "content": SENTINEL},
                        *new_messages]
        text, spans = render_chat_spans(tokenizer, conversation, tools=tools,
                                        special_in_content=special_in_content)
        if text.count(SENTINEL) != 1:
            raise ValueError("this model's chat template does not keep assistant replies "
                             "verbatim, so a session cannot continue the conversation; send "
                             "the whole conversation without a session_id instead")
        start = text.index(SENTINEL) + len(SENTINEL)
        last = self.token_ids[-1]
        if last in tokenizer.all_special_ids:
            closing = tokenizer.decode([last], skip_special_tokens=False)
            if closing and text.startswith(closing, start):
                start += len(closing)
        return self.token_ids + encode_rendered(tokenizer, text, spans, start)

    def commit(self, prompt_ids: Sequence[int], new_messages: JsonObjects,
               reply_ids: Sequence[int], reply_text: str) -> None:
        """A finished turn becomes history."""
        self.token_ids = [*prompt_ids, *reply_ids]
        self.messages += [dict(m) for m in new_messages]
        self.messages.append({"role": "assistant", "content": reply_text})
