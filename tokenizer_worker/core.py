"""The tokenizer process's core, with no sockets (process.py runs it): prompts in (text, chat messages or ids) → token ids to the scheduler;
token ids back from the scheduler → UTF-8-safe text deltas, cut at stop strings, to the frontend.

A stop string ends one sample: the worker emits its final text at once and asks the scheduler
to abort that sample (its pages are released within one step); later tokens already on their
way for it are dropped here.

Sessions (multi-turn chat) live here: the worker that owns a session (the frontend routes all
of a session's messages to one worker) keeps its token history, builds each turn's prompt as
history + the new messages' template fragment, and appends the reply's ids when the turn
finishes (``tokenizer_worker/session.py``). The scheduler's stats pass through to the frontend.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from engine.contracts import structured
from engine.contracts.protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    RequestOutput,
    SeqOutput,
    SessionClose,
    SessionOpen,
    TokenizedRequest,
    TokenizeRequest,
    TokenizerReply,
    TokenOutputs,
    pack_ids,
    unpack_ids,
)
from tokenizer_worker.detokenize import IncrementalDetokenizer
from tokenizer_worker.session import ChatSession
from tokenizer_worker.stop import StopChecker
from tokenizer_worker.template import encode_prompt, render_chat

logger = logging.getLogger("radixserve.tokenizer")


@dataclass
class SampleState:
    detok: IncrementalDetokenizer
    stop: StopChecker
    done: bool = False


@dataclass
class RequestState:
    req: GenerateRequest
    prompt_ids: np.ndarray
    samples: dict[int, SampleState] = field(default_factory=dict)
    finished: int = 0
    session: ChatSession | None = None  # the session this turn continues
    prompt_logprobs_sent: int = 0  # prompt tokens (after the first) whose logprobs went out
    echo_pending: bool = False  # the prompt's text still to go out (echo)
    reply_ids: list[int] = field(default_factory=list)  # a session turn's reply so far
    reply_text: list[str] = field(default_factory=list)


class TokenizerWorker:
    """Pure message handling (no sockets), so tests can drive it directly.

    Nothing one request sends ends this process: whatever tokenizing it raises becomes that
    request's error (400 for input the tokenizer or template refuses, else 500, logged here
    with the request id)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, index: int, *,
                 context_len: int | None = None, special_in_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.index = index
        self.special_in_content = special_in_content
        self.states: dict[str, RequestState] = {}
        self.sessions: dict[str, ChatSession] = {}
        # No token spells more characters than the vocabulary's longest entry (byte-level
        # entries spell bytes, which are never fewer), so a text longer than this cannot fit
        # the context; refusing it before tokenizing keeps a multi-MB prompt from stalling
        # every other request on this worker for seconds.
        self.longest_token = max(map(len, tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = None if context_len is None else context_len * self.longest_token
        self.context_len = context_len
        self._grammar_tokenizer = None  # prepare_grammar, else the first constrained request

    def prepare_grammar(self) -> None:
        """Build the grammar engine's view of the vocabulary now (0.45 s at 49k tokens, 3.8 s at
        262k on a 2-core Xeon, holding the GIL): the process does it before it reports ready,
        so the first constrained request does not stall every request on this worker."""
        if self._grammar_tokenizer is None:
            eos = self.tokenizer.eos_token_id
            self._grammar_tokenizer = structured.grammar_tokenizer(
                self.tokenizer, None, [] if eos is None else [eos])

    def check_constraint(self, req: GenerateRequest) -> None:
        """A request's structured output compiles against this tokenizer (a ValueError naming
        the problem if not: the client's 400), in bounded time (the parser's fuel limits)."""
        spec = req.params.structured_outputs
        if spec is None:
            return
        self.prepare_grammar()
        structured.check(spec, self._grammar_tokenizer)

    def tokenize(self, req: GenerateRequest) -> list[int]:
        given = sum(x is not None for x in (req.text, req.prompt_ids, req.messages))
        if given != 1:
            raise ValueError("give exactly one of a text prompt, prompt token ids or chat messages")
        if req.messages is not None:
            self._check_chars(_chat_chars(req), "the messages have")
            return render_chat(self.tokenizer, req.messages, tools=req.tools,
                               special_in_content=self.special_in_content)
        if req.text is not None:
            self._check_chars(len(req.text), "the prompt has")
            return encode_prompt(self.tokenizer, req.text)
        return unpack_ids(req.prompt_ids).tolist()

    def _check_chars(self, chars: int, subject: str) -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise ValueError(f"{subject} {chars:,} characters, more than the model's context of "
                             f"{self.context_len:,} tokens can hold (no token spells more than "
                             f"{self.longest_token} characters)")

    def on_request(self, req: GenerateRequest) -> TokenizedRequest | RequestOutput:
        session = None
        try:
            if req.session_id is None:
                ids = self.tokenize(req)
            else:
                session = self.sessions.get(req.session_id)
                if session is None:
                    return RequestOutput(rid=req.rid, finish_reason="error", status=404,
                                         error=f"session {req.session_id!r} does not exist")
                ids = self._session_prompt(session, req)
        except ValueError as exc:
            return RequestOutput(rid=req.rid, finish_reason="error", error=str(exc), status=400)
        except RecursionError:
            logger.warning("request %s: its messages recurse too deeply to render", req.rid)
            return RequestOutput(rid=req.rid, finish_reason="error", status=400,
                                 error="the messages nest too deeply to render")
        except Exception:
            logger.exception("tokenizing request %s failed", req.rid)
            return RequestOutput(rid=req.rid, finish_reason="error", status=500,
                                 error="the server failed to tokenize this request; its log "
                                       "has the details")
        try:
            self.check_constraint(req)
        except ValueError as exc:
            return RequestOutput(rid=req.rid, finish_reason="error", error=str(exc), status=400,
                                 about_constraint=True)
        self.states[req.rid] = RequestState(req, np.asarray(ids, dtype=np.int32), session=session,
                                            echo_pending=req.echo)
        return TokenizedRequest(rid=req.rid, prompt_ids=pack_ids(ids), params=req.params,
                                reply_to=self.index, namespace=req.namespace,
                                session_id=req.session_id, lora_name=req.lora_name)

    def on_tokenize(self, msg: TokenizeRequest | DetokenizeRequest) -> TokenizerReply:
        """``/tokenize`` and ``/detokenize``: ids exactly as a completion (text) or chat
        request (messages) of the same prompt would get, or ids' text with special tokens
        spelled out (vLLM's). Errors are the reply's, as ``on_request``'s are."""
        try:
            if isinstance(msg, DetokenizeRequest):
                text = self.tokenizer.decode(unpack_ids(msg.token_ids).tolist(),
                                             skip_special_tokens=False)
                return TokenizerReply(rid=msg.rid, text=text)
            ids = self._tokenize_call(msg)
        except ValueError as exc:
            return TokenizerReply(rid=msg.rid, error=str(exc), status=400)
        except RecursionError:
            return TokenizerReply(rid=msg.rid, error="the messages nest too deeply to render",
                                  status=400)
        except Exception:
            logger.exception("tokenize call %s failed", msg.rid)
            return TokenizerReply(rid=msg.rid, status=500, error="the server failed to "
                                  "tokenize this request; its log has the details")
        strs = self.tokenizer.convert_ids_to_tokens(ids) if msg.return_token_strs else None
        return TokenizerReply(rid=msg.rid, token_ids=pack_ids(ids), token_strs=strs)

    def _tokenize_call(self, msg: TokenizeRequest) -> list[int]:
        if msg.messages is not None:
            self._check_chars(sum(map(_text_chars, msg.messages)), "the messages have")
            ids = render_chat(self.tokenizer, msg.messages, msg.add_generation_prompt,
                              tools=msg.tools, special_in_content=self.special_in_content)
            # The template writes its own BOS; more special tokens only when asked (vLLM's).
            if msg.add_special_tokens:
                ids = self.tokenizer.build_inputs_with_special_tokens(ids)
            return ids
        text = msg.text or ""
        self._check_chars(len(text), "the prompt has")
        if msg.add_special_tokens:
            return encode_prompt(self.tokenizer, text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _session_prompt(self, session: ChatSession, req: GenerateRequest) -> list[int]:
        if req.messages is None:
            raise ValueError("a session turn takes chat messages (the new turn's only)")
        if req.params.n != 1 or req.params.beam_width != 1:
            raise ValueError("a session turn makes one reply: n and beam search must be 1")
        self._check_chars(_chat_chars(req), "the messages have")
        return session.prompt_for(self.tokenizer, req.messages, tools=req.tools,
                                  special_in_content=self.special_in_content)

    def on_session(self, msg: SessionOpen | SessionClose) -> None:
        if isinstance(msg, SessionOpen):
            parent = self.sessions.get(msg.parent) if msg.parent is not None else None
            self.sessions[msg.session_id] = ChatSession() if parent is None else ChatSession(
                list(parent.token_ids), list(parent.messages))
        else:
            self.sessions.pop(msg.session_id, None)

    def on_abort(self, msg: AbortRequest) -> None:
        self.states.pop(msg.rid, None)

    def on_outputs(self, msg: TokenOutputs) -> tuple[list[RequestOutput], list[AbortRequest]]:
        outputs, aborts = [], []
        for out in msg.outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue  # finished here already (stop string) or aborted by the client
            if out.prompt_logprobs:
                outputs.append(self._prompt_logprobs(state, out))
                continue
            if out.error is not None:
                outputs.append(RequestOutput(rid=out.rid, index=out.index, finish_reason="error",
                                             error=out.error, status=out.status))
                self.states.pop(out.rid, None)
                continue
            try:
                result, stopped = self._detokenize(state, out)
            except Exception:
                # The request fails alone; its sequences are aborted in the scheduler.
                logger.exception("detokenizing request %s failed", out.rid)
                outputs.append(RequestOutput(rid=out.rid, index=out.index, finish_reason="error",
                                             status=500, error="the server failed to detokenize "
                                             "this request's output; its log has the details"))
                aborts.append(AbortRequest(out.rid, "error"))
                self.states.pop(out.rid, None)
                continue
            if stopped:
                aborts.append(AbortRequest(out.rid, "stop", out.index))
            if state.echo_pending:
                result.prompt_text, state.echo_pending = self._prompt_text(state), False
            result.result_at = msg.result_at
            outputs.append(result)
            if state.finished >= state.req.params.n:
                self.states.pop(out.rid, None)
        return outputs, aborts

    def _prompt_text(self, state: RequestState) -> str:
        return self.tokenizer.decode(state.prompt_ids.tolist(), skip_special_tokens=False)

    def _prompt_logprobs(self, state: RequestState, out: SeqOutput) -> RequestOutput:
        """The next prompt tokens' logprobs, named by their text (the scheduler sends them in
        prompt order, before the first generated token). The first such output starts with
        the prompt's first token, whose logprob is NaN (it has none) and top rows empty."""
        logprobs = np.frombuffer(out.prompt_logprobs, dtype=np.float32)
        top_ids = unpack_ids(out.prompt_top_ids).reshape(len(logprobs), -1)
        top_lps = np.frombuffer(out.prompt_top_logprobs, dtype=np.float32).reshape(top_ids.shape)
        first = 1 + state.prompt_logprobs_sent
        ids = state.prompt_ids[first : first + len(logprobs)]
        state.prompt_logprobs_sent += len(logprobs)
        if first == 1:
            ids = state.prompt_ids[: len(ids) + 1]
            logprobs = np.concatenate([[np.nan], logprobs]).astype(np.float32)
            top_ids = np.concatenate([np.zeros((1, top_ids.shape[1]), np.int32), top_ids])
            top_lps = np.concatenate([np.full((1, top_ids.shape[1]), np.nan, np.float32),
                                      top_lps])
        result = RequestOutput(
            rid=out.rid, index=0, prompt_tokens=out.prompt_tokens, prompt_token_ids=ids.tobytes(),
            prompt_token_texts=self._token_texts(ids), prompt_logprobs=logprobs.tobytes(),
            prompt_top_ids=top_ids.astype(np.int32).tobytes(),
            prompt_top_logprobs=top_lps.astype(np.float32).tobytes(),
            prompt_top_texts=self._token_texts(top_ids))
        if state.echo_pending:
            result.prompt_text, state.echo_pending = self._prompt_text(state), False
        return result

    def _sample(self, state: RequestState, index: int) -> SampleState:
        sample = state.samples.get(index)
        if sample is None:
            params = state.req.params
            sample = state.samples[index] = SampleState(
                IncrementalDetokenizer(self.tokenizer, state.prompt_ids.tolist(),
                                       params.skip_special_tokens), StopChecker(params.stop))
        return sample

    def _detokenize(self, state: RequestState, out: SeqOutput) -> tuple[RequestOutput, bool]:
        ids = unpack_ids(out.token_ids)
        result = RequestOutput(
            rid=out.rid, index=out.index, token_ids=out.token_ids, logprobs=out.logprobs,
            top_ids=out.top_ids, top_logprobs=out.top_logprobs, finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
            cached_tokens_host=out.cached_tokens_host, cached_tokens_disk=out.cached_tokens_disk,
            replace=out.replace)
        sample = self._sample(state, out.index)
        if sample.done:
            result.token_ids = b""
            return result, False
        if not out.replace:
            kept, delta, stopped = self._feed(sample, ids, bool(state.req.params.stop),
                                              out.finish_reason is not None)
            if kept < len(ids):
                # A stop string inside several tokens at once (a verification's accepted
                # drafts): the tokens after the one that completed it were never generated.
                width = len(out.top_ids) // (4 * len(ids))
                ids = ids[:kept]
                result.token_ids = out.token_ids[: 4 * kept]
                result.logprobs = out.logprobs[: 4 * kept]
                result.top_ids = out.top_ids[: 4 * kept * width]
                result.top_logprobs = out.top_logprobs[: 4 * kept * width]
        if result.logprobs:
            result.token_texts = self._token_texts(ids)
            result.top_texts = self._token_texts(unpack_ids(result.top_ids))
        if out.replace:
            # Beam search sends each final beam whole: decode it in one go.
            text = self.tokenizer.decode(ids.tolist(),
                                         skip_special_tokens=state.req.params.skip_special_tokens)
            emitted, stopped = sample.stop.feed(text)
            result.text = emitted + ("" if stopped else sample.stop.flush())
            stopped = False  # the beam is final already: nothing to abort
        else:
            emitted = delta
            if out.finish_reason is not None and not stopped:
                emitted += sample.stop.flush()
                if sample.stop.matched is not None:  # a stop string settled only at the end
                    result.finish_reason = "stop"
            result.text = emitted
            if state.session is not None:
                state.reply_ids.extend(ids.tolist())
                state.reply_text.append(emitted)
        if stopped:
            result.finish_reason = "stop"
        if result.finish_reason == "stop":
            result.stop_reason = sample.stop.matched
        if result.finish_reason is not None:
            sample.done = True
            state.finished += 1
            if state.session is not None and result.finish_reason in ("stop", "length"):
                state.session.commit(state.prompt_ids.tolist(), state.req.messages,
                                     state.reply_ids, "".join(state.reply_text))
        return result, stopped and out.finish_reason is None

    @staticmethod
    def _feed(sample: SampleState, ids: np.ndarray, has_stops: bool,
              final: bool) -> tuple[int, str, bool]:
        """Detokenize ``ids`` and cut the text at a stop string: (ids kept, text, stopped).
        With stop strings, several ids (a verification's accepted drafts) go in one at a time,
        so the ids kept end at the one whose text completed the stop, as one per step would."""
        pieces = [ids[i : i + 1] for i in range(len(ids))] if has_stops and len(ids) > 1 \
            else [ids]
        texts = []
        for count, piece in enumerate(pieces, 1):
            delta = sample.detok.add(piece)
            if final and count == len(pieces):
                delta += sample.detok.flush()
            text, stopped = sample.stop.feed(delta)
            texts.append(text)
            if stopped:
                return len(ids) if len(pieces) == 1 else count, "".join(texts), True
        return len(ids), "".join(texts), False

    def _token_texts(self, ids: np.ndarray) -> list[str]:
        """Each token's own text (logprobs name tokens by it), special tokens spelled out."""
        return self.tokenizer.batch_decode(ids.reshape(-1, 1).tolist(),
                                           skip_special_tokens=False)


def _chat_chars(req: GenerateRequest) -> int:
    """Characters of a chat request's message texts and tools (as JSON)."""
    tools = len(json.dumps(req.tools)) if req.tools else 0
    return sum(map(_text_chars, req.messages or [])) + tools


def _text_chars(message: object) -> int:
    """Characters of a message's content (a string or text parts), before any validation."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0
