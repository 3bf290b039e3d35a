"""The terminal chat of ``radixserve chat``: a session over the HTTP API, one streamed turn per
line typed, and a ``radixserve serve`` child process when no server was given."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx

from engine.runtime.child import die_with_parent
from engine.runtime.launcher import free_port


class ChatError(RuntimeError):
    """The chat cannot go on (no server, or the server refused the session)."""


@dataclass
class LocalServer:
    proc: subprocess.Popen
    url: str

    @classmethod
    def start(cls, model: str | None, port: int | None = None) -> LocalServer:
        port = free_port() if port is None else port
        command = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port),
                   "--log-level", "error", *(["--model", model] if model else [])]
        log = tempfile.TemporaryFile("w+")
        # Its own session: a Ctrl-C that stops a reply must not reach the server too.
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True,
                                # a clean shutdown if the chat dies, however it dies
                                preexec_fn=partial(die_with_parent, signal.SIGTERM))
        ready = proc.stdout.readline()  # the server prints one line once it serves
        if "serving" not in ready:
            proc.wait()
            log.seek(0)
            raise ChatError(f"the server did not start:\n{log.read().strip()}")
        return cls(proc, f"http://127.0.0.1:{port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def chat(url: str, *, api_key: str | None = None, system: str | None = None,
         max_tokens: int = 256, temperature: float = 0.7) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(30, read=None)) \
            as client:
        try:
            model = _ok(client.get("/v1/models"))["data"][0]["id"]
            session = _ok(client.post("/v1/sessions"))["id"]
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {url}: {exc}") from None
        print(f"chatting with {model} at {url} (session {session}); /quit or Ctrl-D leaves",
              flush=True)
        pending_system = system
        try:
            while True:
                try:
                    line = input("you> ")
                except EOFError:
                    print()
                    break
                if line.strip() in ("/quit", "/exit"):
                    break
                if not line.strip():
                    continue
                messages = [{"role": "user", "content": line}]
                if pending_system:
                    messages.insert(0, {"role": "system", "content": pending_system})
                body = {"session_id": session, "messages": messages, "max_tokens": max_tokens,
                        "temperature": temperature, "stream": True,
                        "stream_options": {"include_usage": True}}
                if _turn(client, body):
                    pending_system = None  # it is part of the session's history now
        finally:
            try:
                client.delete(f"/v1/sessions/{session}")
            except httpx.HTTPError:
                pass  # the server is gone; so is the session


def _ok(response: httpx.Response) -> Any:
    body = response.json()
    if response.status_code != 200:
        raise ChatError(body.get("error", {}).get("message", response.text))
    return body


def _turn(client: httpx.Client, body: dict[str, Any]) -> bool:
    """Stream one reply and its stats line; False when the turn did not complete."""
    start = time.monotonic()
    first_token: float | None = None
    usage = None
    print("assistant> ", end="", flush=True)
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                print(f"\nerror: {response.json()['error']['message']}", flush=True)
                return False
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    print(f"\nerror: {chunk['error']['message']}", flush=True)
                    return False
                if chunk["choices"] and first_token is None:
                    first_token = time.monotonic() - start
                for choice in chunk["choices"]:
                    print(choice["delta"].get("content") or "", end="", flush=True)
                usage = chunk.get("usage") or usage
    except KeyboardInterrupt:
        print("\n[stopped; this turn is dropped]", flush=True)
        return False
    except httpx.HTTPError as exc:
        print(f"\nerror: {exc}", flush=True)
        return False
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    print(f"\n[{usage['prompt_tokens']} prompt tokens, {cached} cached, "
          f"{usage['completion_tokens']} generated; time to first token "
          f"{1000 * (first_token or 0):.0f} ms]", flush=True)
    return True
