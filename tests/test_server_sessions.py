"""Sessions below the HTTP layer, in-process: the tokenizer side's history and template
fragments, the scheduler's pins (expiry, bounds, giving way) over a real radix tree, and a
session's turns through the scheduler and the real model runner."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import TokenizedRequest, pack_ids
from engine.contracts.sampling_params import SamplingParams
from engine.worker.process import Worker
from radix import Lease, PageAllocator, RadixTree
from scheduler.scheduler import Scheduler
from scheduler.session_pins import SessionPins
from tokenizer_worker.session import ChatSession
from tokenizer_worker.template import render_chat, render_chat_text

IM_END = 2  # the demo tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_demo_model())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


# ---------------------------------------------------------------- tokenizer side
@pytest.mark.parametrize("ends_with_im_end", [True, False], ids=["stopped", "cut-by-length"])
def test_a_turn_prompt_is_the_history_plus_the_template_fragment(tokenizer, ends_with_im_end):
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    session = ChatSession()
    prompt = session.prompt_for(tokenizer, first)
    assert prompt == render_chat(tokenizer, first)
    reply = tokenizer.encode("Hello, human.", add_special_tokens=False)
    reply += [IM_END] if ends_with_im_end else []
    session.commit(prompt, first, reply, "Hello, human.")
    follow_up = [{"role": "user", "content": "Again?"}]
    second = session.prompt_for(tokenizer, follow_up)
    assert second[: len(prompt) + len(reply)] == prompt + reply  # never re-tokenised
    whole = render_chat_text(tokenizer, [*first, {"role": "assistant",
                                                  "content": "Hello, human."}, *follow_up])
    # The prompt reads exactly as the template renders the whole conversation.
    assert tokenizer.decode(second, skip_special_tokens=False) == whole


def test_a_template_that_drops_replies_cannot_continue_a_session(tokenizer):
    forgetful = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    forgetful.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}\n{% endif %}"
        "{% endfor %}")
    session = ChatSession()
    session.commit([5, 6], [{"role": "user", "content": "a"}], [7], "b")
    with pytest.raises(ValueError, match="does not keep assistant replies verbatim"):
        session.prompt_for(forgetful, [{"role": "user", "content": "c"}])


# -------------------------------------------------------------------- pins alone
def _cached_tree(tokens_per_history: list[list[int]], page_size: int = 4):
    alloc = PageAllocator(64, page_size)
    tree = RadixTree(alloc)
    for tokens in tokens_per_history:
        lease = Lease(tree, tokens, max_len=0, count=False)
        pages, _ = lease.acquire(len(tokens))
        lease.release(pages, tokens)  # the finished sequence lets go; only the tree holds them
    return alloc, tree


def test_pins_lock_histories_until_they_expire_or_are_replaced():
    history = list(range(10, 30))
    alloc, tree = _cached_tree([history, history + [40, 41, 42, 43]])
    pins = SessionPins(tree, max_pinned_tokens=100)
    pins.open("s", ttl=10.0)
    pins.pin("s", history, None, now=0.0)
    assert tree.stats.queries == 0  # pinning is not a lookup
    assert pins.pinned_tokens == 20 and alloc.num_pinned_pages == 5
    assert tree.evict(64) == 1  # only the longer history's own tail page can go
    assert pins.seconds_to_next_expiry(now=4.0) == 6.0
    pins.pin("s", history[:12], None, now=5.0)  # the next turn replaces the pin
    assert pins.pinned_tokens == 12 and pins.seconds_to_next_expiry(now=5.0) == 10.0
    pins.expire(now=14.9)
    assert pins.pinned_tokens == 12
    pins.expire(now=15.0)
    assert pins.pinned_tokens == 0 and pins.seconds_to_next_expiry(now=15.0) is None
    assert alloc.num_pinned_pages == 0
    tree.check()


def test_pinned_tokens_are_bounded_oldest_first_and_closed_sessions_pin_nothing():
    histories = [[i] * 8 + list(range(100, 108)) for i in (1, 2, 3)]
    alloc, tree = _cached_tree(histories)
    pins = SessionPins(tree, max_pinned_tokens=40)
    for name in ("a", "b", "c"):
        pins.open(name, ttl=60.0)
    for name, history in zip("abc", histories, strict=True):
        pins.pin(name, history, None, now=0.0)
    assert list(pins.pins) == ["b", "c"] and pins.pinned_tokens == 32  # "a" gave way
    pins.pin("a", list(range(50)), None, now=0.0)  # longer than the bound: not pinned
    assert "a" not in pins.pins
    pins.close("b")
    pins.pin("b", histories[1], None, now=0.0)
    assert list(pins.pins) == ["c"]
    assert pins.unpin_oldest() and not pins.unpin_oldest()
    tree.check()


# ------------------------------------------------------- through the scheduler
class SessionHarness:
    """The scheduler driven in-process with the real model runner (no sockets)."""

    def __init__(self, model_dir: str, **options) -> None:
        config = EngineConfig(model=model_dir, **options)
        self.worker = Worker(config)
        self.sched = Scheduler(config, self.worker.info)
        self.finals: dict[str, object] = {}

    def run(self, rid: str, prompt: list[int], max_tokens: int, session: str | None = None,
            ) -> tuple[list[int], int]:
        """Run one request to its end; its output ids and cached tokens."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.sched.add_request(TokenizedRequest(rid=rid, prompt_ids=pack_ids(prompt),
                                                params=params, reply_to=0, session_id=session))
        output, cached = [], 0
        while not self.sched.idle:
            batch = self.sched.schedule()
            if batch is not None:
                self.sched.process_result(self.worker.step(batch))
            for out in self.sched.take_outputs().get(0, []):
                assert out.error is None, out.error
                output += np.frombuffer(out.token_ids, np.int32).tolist()
                cached = out.cached_tokens
        self.sched.check()
        return output, cached


def test_a_session_turn_caches_its_last_token_and_stays_pinned(model_dir):
    h = SessionHarness(model_dir, num_pages=64, page_size=16)
    h.sched.sessions.open("s", ttl=60.0)
    history: list[int] = []
    for turn in range(3):
        prompt = history + [100 + turn, 200 + turn, 300 + turn]
        output, cached = h.run(f"t{turn}", prompt, max_tokens=5, session="s")
        assert cached == len(history)  # the whole history, its last generated token included
        history = prompt + output
        assert h.sched.sessions.pinned_tokens == len(history)
    assert h.sched.alloc.num_pinned_pages >= h.sched.alloc.pages_for(len(history))
    h.sched.sessions.close("s")
    assert h.sched.alloc.num_pinned_pages == 0


def test_pinned_sessions_give_way_to_a_request_that_needs_the_pool(model_dir):
    h = SessionHarness(model_dir, num_pages=8, page_size=16, max_pinned_tokens=100)
    h.sched.sessions.open("s", ttl=60.0)
    h.run("turn", list(range(5, 85)), max_tokens=4, session="s")
    assert h.sched.sessions.pinned_tokens == 84  # 6 of the 8 pages
    output, _ = h.run("big", list(range(1000, 1090)), max_tokens=10)
    assert len(output) == 10
    assert h.sched.sessions.pinned_tokens == 0
