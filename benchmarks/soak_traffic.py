"""The soak's request mix (``benchmarks/soak.py``): agent sessions with tools through chat
completions, Messages and Responses, images, embeddings, LoRA adapter switches, cancelled
streams, bad inputs, and the spare model's load and unload cycles."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import time
from collections import Counter

import httpx

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ("Paris", "Lima", "Oslo", "Pune", "Quito", "Hanoi")
BAD_INPUTS = (  # (path, httpx arguments): each must get a 4xx
    ("/v1/chat/completions", {"content": b'{"messages": [', "headers": {"content-type": "application/json"}}),
    ("/v1/chat/completions", {"json": {"model": "chat", "messages": "not a list"}}),
    ("/v1/chat/completions", {"json": {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}}),
    ("/v1/messages", {"json": {"model": "chat", "max_tokens": -1, "messages": []}}),
    ("/v1/responses", {"json": {"model": "chat", "input": [{"type": "bogus"}]}}),
)


def png_data_url(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    """A noisy PNG of ``size`` (width, height pixels) as a data URL (needs Pillow, which mlx-vlm brings)."""
    import numpy as np
    from PIL import Image

    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Traffic:
    """The soak's request mix (see the module docstring) on ``client``; ``gw`` is the
    ``soak.Gateway`` (what it serves: ``vision``, ``embedding``, ``adapters``). ``statuses``
    counts ``(scenario, status)`` and ``failures`` keeps the first unexpected answers."""

    def __init__(self, gw, client: httpx.AsyncClient, seed: int):
        self.gw, self.c, self.rng = gw, client, random.Random(seed)
        self.statuses: Counter = Counter()
        self.failures: list[str] = []
        names = ["chat_agent", "messages_agent", "responses_agent", "cancel", "bad_input"]
        names += ["vision"] * gw.vision + ["embeddings"] * gw.embedding + ["adapter_switch"] * bool(gw.adapters)
        self.scenarios = names

    def record(self, name: str, status: int, text: str = "", ok=range(200, 300)) -> None:
        self.statuses[(name, status)] += 1
        if status not in ok and len(self.failures) < 20:
            self.failures.append(f"{name}: {status} {text[:300]}")

    async def one(self) -> None:
        name = self.rng.choice(self.scenarios)
        try:
            await getattr(self, name)()
        except httpx.HTTPError as e:
            self.record(name, 0, repr(e))

    async def chat_agent(self) -> None:
        city = self.rng.choice(CITIES)
        messages = [{"role": "system", "content": "You are a weather agent. Use the tools."},
                    {"role": "user", "content": f"Weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": f"{self.rng.randint(-5, 35)} C, clear"}]
        body = {"model": "chat", "messages": messages, "tools": [TOOL], "max_tokens": self.rng.randint(4, 24)}
        if self.rng.random() < 0.5:
            async with self.c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                text = "".join([line async for line in r.aiter_lines()])
                ok = r.status_code == 200 and "[DONE]" in text and '"error"' not in text
                self.record("chat_agent", r.status_code if ok else 599, text)
        else:
            r = await self.c.post("/v1/chat/completions", json=body)
            self.record("chat_agent", r.status_code, r.text)

    async def messages_agent(self) -> None:
        city = self.rng.choice(CITIES)
        tool = {"name": "get_weather", "description": "Weather of a city.",
                "input_schema": TOOL["function"]["parameters"]}
        messages = [{"role": "user", "content": f"Weather in {city}?"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                       "input": {"city": city}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                  "content": "sunny"}]}]
        r = await self.c.post("/v1/messages", json={"model": "chat", "max_tokens": self.rng.randint(4, 24),
                                                    "system": "A weather agent.", "tools": [tool],
                                                    "messages": messages})
        self.record("messages_agent", r.status_code, r.text)

    async def responses_agent(self) -> None:
        city = self.rng.choice(CITIES)
        tool = {"type": "function", **TOOL["function"]}
        first = await self.c.post("/v1/responses", json={
            "model": "chat", "instructions": "A weather agent.", "tools": [tool], "max_output_tokens": 8,
            "input": [{"role": "user", "content": f"Weather in {city}?"},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather",
                       "arguments": json.dumps({"city": city})},
                      {"type": "function_call_output", "call_id": "c1", "output": "rain"}]})
        self.record("responses_agent", first.status_code, first.text)
        if first.status_code == 200:
            r = await self.c.post("/v1/responses", json={"model": "chat", "previous_response_id": first.json()["id"],
                                                         "input": "And tomorrow?", "max_output_tokens": 8})
            self.record("responses_agent", r.status_code, r.text)

    async def vision(self) -> None:
        content = [{"type": "image_url", "image_url": {"url": png_data_url(self.rng.randint(0, 7))}},
                   {"type": "text", "text": "What is in the picture?"}]
        r = await self.c.post("/v1/chat/completions", json={"model": "vision", "max_tokens": 6,
                                                            "messages": [{"role": "user", "content": content}]})
        self.record("vision", r.status_code, r.text)

    async def adapter_switch(self) -> None:
        """A chat on a random adapter or the base (with ``--max-loras`` below the adapters'
        count, a switch unloads one and reads another)."""
        model = self.rng.choice(("chat", *self.gw.adapters))
        r = await self.c.post("/v1/chat/completions", json={"model": model, "max_tokens": self.rng.randint(4, 16),
                                                            "messages": [{"role": "user", "content": "Say hello."}]})
        self.record("adapter_switch", r.status_code, r.text)

    async def embeddings(self) -> None:
        inputs = [f"document {self.rng.randint(0, 10**6)} about {c}" for c in CITIES[:self.rng.randint(1, 6)]]
        r = await self.c.post("/v1/embeddings", json={"model": "embed", "input": inputs})
        self.record("embeddings", r.status_code, r.text)

    async def cancel(self) -> None:
        body = {"model": "chat", "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with self.c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # leave mid-stream: the gateway must cancel the row and free its lease
            self.record("cancel", r.status_code)

    async def bad_input(self) -> None:
        path, kw = self.rng.choice(BAD_INPUTS)
        r = await self.c.post(path, **kw)
        self.record("bad_input", r.status_code, r.text, ok=range(400, 500))

    async def load_cycle(self) -> None:
        """Load the spare model, use it, unload it (the admin API)."""
        r = await self.c.post("/admin/models/spare/load", timeout=300)
        self.record("admin_load", r.status_code, r.text)
        r = await self.c.post("/v1/chat/completions", json={"model": "spare", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        self.record("spare", r.status_code, r.text, ok=(200, 503))  # 503 while it unloads is fine
        await self.unload()

    async def unload(self) -> None:
        r = await self.c.post("/admin/models/spare/unload", timeout=300)
        self.record("admin_unload", r.status_code, r.text)

    async def run(self, seconds: float, workers: int, load_every: float) -> None:
        end = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < end:
                await self.one()

        async def loader() -> None:
            while time.monotonic() + load_every < end:
                await asyncio.sleep(load_every)
                await self.load_cycle()

        await asyncio.gather(*(worker() for _ in range(workers)), loader())
