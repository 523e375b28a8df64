"""Every SSE event stays on its lines however a client splits text into lines: JSON
strings may hold U+0085, U+2028 and U+2029, which Python's str.splitlines (and many
JavaScript readers) take as line breaks. Found by fuzzing /v1/responses with a
metadata key "\\u0085"."""

from __future__ import annotations

import json

from conftest import live_server, model_path

ODD = "a\x85b\u2028c\u2029d"


def data_lines(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_line_separators_in_event_data_are_escaped():
    with live_server(model_path("qwen3")) as server, server.client() as c:
        r = c.post("/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 4,
                                          "metadata": {ODD: ODD}})
        assert r.status_code == 200, r.text
        events = data_lines(r.text)
        assert events and events[0]["response"]["metadata"] == {ODD: ODD}
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ODD}], "stream": True,
                                                 "max_tokens": 4, "user": ODD})
        assert r.status_code == 200, r.text
        assert data_lines(r.text)


def test_text_events_are_the_bytes_of_the_whole_chunk():
    """A chunk put together around its text (the streaming path) is byte for byte the
    chunk encoded whole, for text that JSON escapes and a model named like the hole."""
    from gateway.http.sse import HOLE, sse, text_events
    from gateway.protocols.openai_format import chat_chunk, text_completion

    for model in ("m", HOLE, 'a "quoted" \\ name é'):
        completion = text_events(text_completion("cmpl-1", model, HOLE, None, None, None, 123))
        chat = text_events(chat_chunk("chatcmpl-1", model, 123, {"content": HOLE}))
        for text in ("hi", ODD, '"\\\n\t\x00\x1f\x7f', "é中😀", " "):
            assert completion(text) == sse(text_completion("cmpl-1", model, text, None, None, None, 123))
            assert chat(text) == sse(chat_chunk("chatcmpl-1", model, 123, {"content": text}))


def test_a_stream_whose_client_stops_taking_chunks_ends_after_the_send_timeout():
    """A send that does not return within ``send_timeout`` (a client that stopped reading)
    ends the stream and closes its body (which cancels the generation); sends that
    return go on however long the stream lasts."""
    import anyio

    from gateway.http.sse import SSEResponse

    async def scenario(stall_at: int):
        closed, sent = [], []

        async def body():
            try:
                for i in range(12):
                    await anyio.sleep(0.05)
                    yield b"%d" % i
            finally:
                closed.append(True)

        async def send(message):
            if len(sent) == stall_at:
                await anyio.sleep(60)
            sent.append(message)

        async def receive():
            await anyio.sleep(60)

        t = anyio.current_time()
        with anyio.fail_after(10):
            await SSEResponse(body(), send_timeout=0.2)({"type": "http"}, receive, send)
        return anyio.current_time() - t, len(sent), closed

    took, n, closed = anyio.run(scenario, 4)
    assert 0.2 <= took - 4 * 0.05 < 0.5 and n == 4 and closed == [True]
    took, n, closed = anyio.run(scenario, 99)  # 0.6 s of chunks, none of them stalled
    assert n == 14 and closed == [True]
