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
