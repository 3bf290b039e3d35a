"""Synthetic traces of the traffic shapes prefix caching is for, deterministic for a seed.

Each kind is a parameter dataclass (its fields are the CLI flags, their ``help`` metadata the
flag help) and a generator that draws ``Draft``s: prompts as role-tagged runs of token ids, so
the same draw renders either as token ids or, through a tokenizer, as text::

    shared-prefix  [system g][question]                       groups of prompts, one prefix each
    multi-turn     [system s][u1][a1][u2][a2]..[uk]           each turn re-sends the history
    tree           [problem][b1][t1][b2][t2]..[bd]            forks: width children per node
    few-shot       [instruction][ex i][ex j]..[query]         examples drawn from a task's pool
    random         [prompt]                                   nothing shared

Arrivals are Poisson at ``rate``; a conversation's next turn (a tree's next level) follows its
predecessor after an exponential think time.

A trace renders as radixserve's JSONL (``iter_trace``) or, for traces too big to check by eye
in token ids, as Mooncake's hash-id format (``iter_mooncake``): the same draw either way, so
both readers can be timed on the same content. Drafts share their history arrays, and lines
are rendered one at a time, so a 145M-token trace is written without holding it as lists.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.profiler.trace import DEFAULT_VOCAB_SIZE, TraceRequest, encode_chat


def _param(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class SharedPrefixParams:
    groups: int = _param(8, "number of distinct system prompts")
    prompts_per_group: int = _param(16, "requests per group (on average, with zipf)")
    system_len: int = _param(500, "system prompt length in tokens")
    question_len: int = _param(60, "question length in tokens")
    output_len: int = _param(64, "output length in tokens")
    popularity: str = _param("uniform", "how requests pick a group",
                             choices=("uniform", "zipf"))
    zipf_s: float = _param(1.2, "zipf exponent: group k is picked with weight 1/k^s")
    rate: float = _param(4.0, "requests per second (Poisson)")


@dataclass
class MultiTurnParams:
    conversations: int = _param(16, "number of conversations")
    turns: int = _param(6, "user turns per conversation")
    systems: int = _param(1, "distinct system prompts; each conversation picks one at random")
    system_len: int = _param(250, "system prompt length in tokens")
    turn_len: int = _param(64, "median user turn length (lognormal)")
    output_len: int = _param(128, "median reply length (lognormal)")
    sigma: float = _param(0.6, "lognormal sigma of turn and reply lengths")
    rate: float = _param(0.5, "new conversations per second (Poisson)")
    think_time: float = _param(8.0, "mean seconds between a reply and the next turn")


@dataclass
class TreeParams:
    trees: int = _param(4, "number of independent problems")
    depth: int = _param(3, "levels of thoughts below the problem")
    width: int = _param(3, "children per node")
    root_len: int = _param(380, "problem statement length in tokens")
    branch_len: int = _param(20, "per-branch instruction length in tokens")
    thought_len: int = _param(90, "output (thought) length in tokens")
    rate: float = _param(0.2, "new trees per second (Poisson)")
    step_time: float = _param(2.0, "mean seconds between a node's reply and its children")


@dataclass
class FewShotParams:
    tasks: int = _param(4, "number of tasks, each with its own instruction and example pool")
    pool: int = _param(12, "examples per task pool")
    shots: int = _param(6, "examples per prompt, drawn from the pool (kept in pool order)")
    instruction_len: int = _param(60, "instruction length in tokens")
    example_len: int = _param(90, "example length in tokens")
    query_len: int = _param(40, "query length in tokens")
    output_len: int = _param(16, "output length in tokens")
    requests: int = _param(128, "number of requests")
    rate: float = _param(4.0, "requests per second (Poisson)")


@dataclass
class RandomParams:
    requests: int = _param(128, "number of requests")
    prompt_len: int = _param(512, "mean prompt length (uniform in [len/2, 3 len/2])")
    output_len: int = _param(64, "output length in tokens")
    rate: float = _param(4.0, "requests per second (Poisson)")


@dataclass
class Draft:
    """A request before rendering: its prompt as (role, token ids) runs, and its output."""

    arrival: float
    parts: list[tuple[str, np.ndarray]]
    output: np.ndarray
    session_id: str | None = None

    @property
    def prompt(self) -> np.ndarray:
        return np.concatenate([ids for _, ids in self.parts])


Sample = Callable[[int], np.ndarray]  # n -> n token ids


def _poisson(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """``n`` Poisson arrival times, the first at 0."""
    gaps = rng.exponential(1.0 / rate, max(n - 1, 0))
    return np.concatenate([np.zeros(min(n, 1)), np.cumsum(gaps)])


def _lognormal(rng: np.random.Generator, median: int, sigma: float) -> int:
    return max(1, round(median * float(np.exp(sigma * rng.standard_normal()))))


def shared_prefix(p: SharedPrefixParams, rng: np.random.Generator, sample: Sample) -> list[Draft]:
    systems = [sample(p.system_len) for _ in range(p.groups)]
    total = p.groups * p.prompts_per_group
    if p.popularity == "zipf":
        weights = 1.0 / np.arange(1, p.groups + 1) ** p.zipf_s
        group_of = rng.choice(p.groups, total, p=weights / weights.sum())
    else:
        group_of = np.repeat(np.arange(p.groups), p.prompts_per_group)
        rng.shuffle(group_of)
    arrivals = _poisson(rng, total, p.rate)
    return [Draft(float(t), [("system", systems[g]), ("user", sample(p.question_len))],
                  sample(p.output_len)) for t, g in zip(arrivals, group_of, strict=True)]


def grouped_prompt_ids(rng: np.random.Generator, groups: int, per_group: int, head_len: int,
                       question_len: int, low: int, high: int,
                       shared: bool = True) -> list[list[int]]:
    """The shared-prefix draw's prompts alone, as token ids in ``[low, high)`` (benchmarks send
    them with lengths of their own): ``groups`` heads of ``per_group`` prompts each,
    interleaved as real traffic arrives; with ``shared`` False every prompt has a head of its
    own."""
    heads, per_head = (groups, per_group) if shared else (groups * per_group, 1)
    params = SharedPrefixParams(groups=heads, prompts_per_group=per_head, system_len=head_len,
                                question_len=question_len, output_len=0)
    drafts = shared_prefix(params, rng, lambda n: rng.integers(low, high, n))
    return [draft.prompt.tolist() for draft in drafts]


def multi_turn(p: MultiTurnParams, rng: np.random.Generator, sample: Sample) -> list[Draft]:
    systems = [sample(p.system_len) for _ in range(p.systems)]
    drafts = []
    for conv, start in enumerate(_poisson(rng, p.conversations, p.rate)):
        # One system prompt draws nothing here, so its traces stay what they were for a seed.
        system = systems[int(rng.integers(p.systems))] if p.systems > 1 else systems[0]
        history: list[tuple[str, np.ndarray]] = [("system", system)]
        arrival = float(start)
        for _ in range(p.turns):
            history.append(("user", sample(_lognormal(rng, p.turn_len, p.sigma))))
            reply = sample(_lognormal(rng, p.output_len, p.sigma))
            drafts.append(Draft(arrival, list(history), reply, f"conv-{conv}"))
            history.append(("assistant", reply))
            arrival += float(rng.exponential(p.think_time))
    return drafts


def tree(p: TreeParams, rng: np.random.Generator, sample: Sample) -> list[Draft]:
    drafts = []
    for index, start in enumerate(_poisson(rng, p.trees, p.rate)):
        # Frontier entries: (context so far, arrival of the level below it).
        frontier = [([("user", sample(p.root_len))], float(start))]
        for _ in range(p.depth):
            below = []
            for context, arrival in frontier:
                for _ in range(p.width):
                    parts = context + [("user", sample(p.branch_len))]
                    thought = sample(p.thought_len)
                    drafts.append(Draft(arrival, parts, thought, f"tree-{index}"))
                    below.append((parts + [("assistant", thought)],
                                  arrival + float(rng.exponential(p.step_time))))
            frontier = below
    return drafts


def few_shot(p: FewShotParams, rng: np.random.Generator, sample: Sample) -> list[Draft]:
    if p.shots > p.pool:
        raise ValueError(f"--shots {p.shots} is more than the pool of {p.pool} examples")
    instructions = [sample(p.instruction_len) for _ in range(p.tasks)]
    pools = [[sample(p.example_len) for _ in range(p.pool)] for _ in range(p.tasks)]
    drafts = []
    for arrival in _poisson(rng, p.requests, p.rate):
        task = int(rng.integers(p.tasks))
        picked = np.sort(rng.choice(p.pool, p.shots, replace=False))
        parts = [("user", instructions[task])] + [("user", pools[task][i]) for i in picked]
        parts.append(("user", sample(p.query_len)))
        drafts.append(Draft(float(arrival), parts, sample(p.output_len)))
    return drafts


def random_prompts(p: RandomParams, rng: np.random.Generator, sample: Sample) -> list[Draft]:
    lengths = rng.integers(max(1, p.prompt_len // 2), p.prompt_len * 3 // 2 + 1, p.requests)
    return [Draft(float(t), [("user", sample(int(n)))], sample(p.output_len))
            for t, n in zip(_poisson(rng, p.requests, p.rate), lengths, strict=True)]


@dataclass(frozen=True)
class Kind:
    params: type
    generate: Callable[[Any, np.random.Generator, Sample], list[Draft]]
    chat: bool  # text traces of this kind carry ``messages`` (else a ``prompt`` string)
    help: str


KINDS: dict[str, Kind] = {
    "shared-prefix": Kind(SharedPrefixParams, shared_prefix, True,
                          "groups of prompts sharing a system prompt"),
    "multi-turn": Kind(MultiTurnParams, multi_turn, True,
                       "conversations re-sending their whole history each turn"),
    "tree": Kind(TreeParams, tree, False, "tree-of-thought forks: depth levels, width children"),
    "few-shot": Kind(FewShotParams, few_shot, False,
                     "prompts of a task's instruction and examples drawn from its pool"),
    "random": Kind(RandomParams, random_prompts, False, "independent prompts, nothing shared"),
}


class TextCodec:
    """Renders drafts as text through a tokenizer: drafts draw from the tokenizer's printable
    ASCII, non-special tokens, so decoded text reads as (odd) words and re-tokenizes to about
    the same length."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids)
        self.ids = np.array([i for i in range(len(tokenizer)) if i not in special
                             and self._clean(tokenizer.decode([i]))], dtype=np.int32)
        if self.ids.size == 0:
            raise ValueError("the tokenizer has no printable ASCII tokens to build text from")

    @staticmethod
    def _clean(text: str) -> bool:
        return bool(text.strip()) and text.isascii() and text.isprintable()

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist())

    def reply_ids(self, messages: list[dict[str, Any]], reply: str) -> list[int]:
        """The reply as the next turn's chat template renders it, so that the output the
        simulator caches is what the following turn re-sends."""
        prompt = encode_chat(self.tokenizer, messages)
        full = encode_chat(self.tokenizer, messages + [{"role": "assistant", "content": reply}],
                           add_generation_prompt=False)
        if full[: len(prompt)] == prompt and len(full) > len(prompt):
            return full[len(prompt):]
        return self.tokenizer.encode(reply, add_special_tokens=False)


def _drafts(kind: str, params: Any, seed: int, codec: TextCodec | None,
            vocab_size: int) -> list[Draft]:
    """The draw of a trace, in arrival order (stable)."""
    rng = np.random.default_rng(seed)
    if codec is None:
        def sample(n: int) -> np.ndarray:
            return rng.integers(0, vocab_size, n, dtype=np.int32)
    else:
        def sample(n: int) -> np.ndarray:
            return rng.choice(codec.ids, n)
    drafts = KINDS[kind].generate(params, rng, sample)
    drafts.sort(key=lambda d: d.arrival)
    return drafts


def iter_trace(kind: str, params: Any, seed: int, tokenizer: Any = None,
               vocab_size: int = DEFAULT_VOCAB_SIZE) -> Iterator[TraceRequest]:
    """Draw a trace of ``kind`` (now: a bad combination of parameters raises here) and render
    it a line at a time as it is iterated: token ids, or text when a tokenizer is given."""
    codec = TextCodec(tokenizer) if tokenizer is not None else None
    chat = KINDS[kind].chat
    drafts = _drafts(kind, params, seed, codec, vocab_size)
    return (_render(f"{kind}-{i:05d}", d, codec, chat) for i, d in enumerate(drafts))


def generate(kind: str, params: Any, seed: int, tokenizer: Any = None,
             vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[TraceRequest]:
    """``iter_trace`` as a list."""
    return list(iter_trace(kind, params, seed, tokenizer, vocab_size))


class BlockHashes:
    """Mooncake's hash ids: one per ``block_tokens``-token block of a prompt (the last may be
    partial), numbered in order of first appearance, equal exactly where two prompts share that
    block and every block before it (the id of a block is looked up by its parent's id and its
    own tokens)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple[int, bytes], int] = {}

    def __call__(self, prompt: np.ndarray) -> list[int]:
        data = np.ascontiguousarray(prompt, dtype=np.int32).tobytes()
        step = 4 * self.block_tokens
        chain, parent = [], -1
        for start in range(0, len(data), step):
            digest = hashlib.blake2b(data[start : start + step], digest_size=16).digest()
            parent = self._ids.setdefault((parent, digest), len(self._ids))
            chain.append(parent)
        return chain


def iter_mooncake(kind: str, params: Any, seed: int, vocab_size: int = DEFAULT_VOCAB_SIZE,
                  block_tokens: int = 512) -> Iterator[dict[str, Any]]:
    """The trace ``iter_trace`` draws for these arguments (token ids), as Mooncake lines:
    milliseconds, lengths and the prompt's block hash ids. Request ids and sessions are not in
    the format; ``radixserve profile --format mooncake`` reads it back."""
    hashes = BlockHashes(block_tokens)
    drafts = _drafts(kind, params, seed, None, vocab_size)
    return ({"timestamp": round(round(d.arrival, 3) * 1000), "input_length": len(d.prompt),
             "output_length": len(d.output), "hash_ids": hashes(d.prompt)} for d in drafts)


def _render(request_id: str, draft: Draft, codec: TextCodec | None, chat: bool) -> TraceRequest:
    request = TraceRequest(id=request_id, arrival=round(draft.arrival, 3),
                           session_id=draft.session_id)
    if codec is None:
        request.prompt_token_ids = draft.prompt.tolist()
        request.output_token_ids = draft.output.tolist()
    elif chat:
        request.messages = [{"role": role, "content": codec.decode(ids)} for role, ids in draft.parts]
        request.output_token_ids = codec.reply_ids(request.messages, codec.decode(draft.output))
    else:
        request.prompt = codec.decode(draft.prompt)
        request.output_token_ids = draft.output.tolist()
    return request
