"""A steady mixed load for ``tests/test_chaos.py``: client threads, each sending one kind
of request in a loop (chat streamed and not, Anthropic Messages streamed, Responses chains
keyed by ``prompt_cache_key``, two tenants kept above their request limits, chat straight
to the router), and recording every outcome with its times.

An outcome is ``ok`` (a 200 whose stream, if any, reached its protocol's end), ``429``,
``status`` (another error status), ``event`` (a stream that ended with its protocol's
error event) or ``cut`` (a broken connection, or a stream that ended without its end).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import httpx

BOUND = 30.0  # seconds: a request still running after this has hung

ENDS = {"openai": ("data: [DONE]", 'data: {"error"'),
        "anthropic": ("event: message_stop", "event: error"),
        "responses": ("event: response.completed", "event: response.failed")}


@dataclass
class Outcome:
    client: str
    tenant: str
    start: float
    end: float
    outcome: str
    detail: str = ""


@dataclass
class Ask:
    """One request: where, what, and which protocol's stream ends it."""

    path: str
    body: dict
    protocol: str = "openai"


class Client:
    """A thread sending ``make(n)`` requests to ``url`` with ``key`` until stopped,
    ``pause`` seconds apart."""

    def __init__(self, name: str, url: str, key: str, tenant: str, make: Callable[[int], Ask], pause: float = 0.0):
        self.name, self.url, self.key, self.tenant = name, url, key, tenant
        self.make, self.pause = make, pause
        self.results: list[Outcome] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"chaos-{name}", daemon=True)

    def one(self, c: httpx.Client, ask: Ask) -> tuple[str, str]:
        stream = bool(ask.body.get("stream"))
        headers = {"Authorization": f"Bearer {self.key}", "x-api-key": self.key}
        with c.stream("POST", ask.path, json=ask.body, headers=headers) as r:
            data = r.read().decode()
        if r.status_code == 429:
            return "429", data[:200]
        if r.status_code != 200:
            return "status", f"{r.status_code} {data[:200]}"
        end, error = ENDS[ask.protocol]
        if stream:
            if error in data:
                return "event", data[data.index(error):][:200]
            if end not in data and not (ask.protocol == "responses" and "event: response.incomplete" in data):
                return "cut", f"stream ended without its end: {data[-200:]}"
        return "ok", ""

    def run(self) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=BOUND) as c:
            while not self.stop.is_set():
                n += 1
                ask = self.make(n)
                t0 = time.monotonic()
                try:
                    outcome, detail = self.one(c, ask)
                except httpx.HTTPError as e:
                    outcome, detail = "cut", repr(e)[:200]
                self.results.append(Outcome(self.name, self.tenant, t0, time.monotonic(), outcome, detail))
                if self.pause:
                    self.stop.wait(self.pause)

    def start(self) -> "Client":
        self.thread.start()
        return self

    def finish(self) -> bool:
        """Stop; False when the thread is still in a request after ``BOUND`` more seconds."""
        self.stop.set()
        self.thread.join(BOUND + 5)
        return not self.thread.is_alive()


def chat(model: str, text: str, stream: bool = False, **extra) -> Ask:
    return Ask("/v1/chat/completions", {"model": model, "max_tokens": 12, "stream": stream,
                                        "messages": [{"role": "user", "content": text}], **extra})


def messages(model: str, text: str, stream: bool = False, user: Optional[str] = None) -> Ask:
    body = {"model": model, "max_tokens": 12, "stream": stream, "messages": [{"role": "user", "content": text}]}
    if user:
        body["metadata"] = {"user_id": user}
    return Ask("/v1/messages", body, "anthropic")


class ResponsesChain:
    """Conversations on ``/v1/responses`` keyed by ``prompt_cache_key``, each sent with its
    whole history (no ``previous_response_id``: a chain of stored responses lives on one
    replica, which a fault may take away), every other turn streamed; a new conversation
    every ``turns`` turns."""

    def __init__(self, model: str, name: str, turns: int = 5):
        self.model, self.name, self.turns = model, name, turns
        self.history: list[dict] = []
        self.conversation = 0

    def make(self, n: int) -> Ask:
        if n % self.turns == 1:
            self.conversation += 1
            self.history = []
        self.history.append({"role": "user", "content": f"{self.name} turn {n}: and then what happened?"})
        body = {"model": self.model, "instructions": f"You tell the story of {self.name}.", "input": list(self.history),
                "max_output_tokens": 12, "store": False, "stream": n % 2 == 0,
                "prompt_cache_key": f"{self.name}-{self.conversation}"}
        self.history.append({"role": "assistant", "content": "(a turn)"})
        return Ask("/v1/responses", body, "responses")
