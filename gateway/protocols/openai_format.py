"""OpenAI response objects: chat completions, text completions, their stream chunks."""

from __future__ import annotations

import time
from typing import Optional

from gateway.conversation.form import Usage
from gateway.conversation.generation import new_id
from gateway.front import Call
from gateway.http.errors import APIError
from gateway.http.sse import sse
from gateway.protocols.respond import Format
from scheduler.request import TokenEvent


def finish_reason(reason: str) -> str:
    """OpenAI's ``finish_reason`` for an internal one (OpenAI has one ``stop`` for the
    end of a turn and a stop string)."""
    return "stop" if reason == "stop_sequence" else reason


class OpenAIFormat(Format):
    """An OpenAI answer (:class:`gateway.protocols.respond.Format`): id ``prefix-...``, a
    stream's error as a data event, ``data: [DONE]`` at its end."""

    tail = sse("[DONE]")

    def __init__(self, req, call: Call, prefix: str):
        self.req, self.stream, self.call = req, bool(req.stream), call
        self.rid, self.created, self.logprobs = new_id(prefix), int(time.time()), None

    def error(self, e: APIError) -> bytes:
        return sse(e.body())


def usage(u: Usage) -> dict:
    """The ``usage`` object, with ``prompt_tokens_details.cached_tokens`` and
    ``completion_tokens_details.reasoning_tokens`` (generated tokens that carried only thinking)."""
    return {"prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.prompt + u.completion,
            "prompt_tokens_details": {"cached_tokens": u.cached},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning}}


# OpenAI's logprob for a token that is practically impossible (its API reference: "-9999.0
# is used to signify that the token is very unlikely"). A token a grammar rules out has
# -inf, which JSON cannot carry.
UNLIKELY = -9999.0


def _json_logprob(lp: float) -> float:
    return lp if lp > UNLIKELY else UNLIKELY


def token_bytes(tokenizer, token: int) -> Optional[bytes]:
    """The raw bytes of ``token`` from its vocabulary entry: a byte-level BPE piece, or a
    SentencePiece byte token (``<0xE4>``); None when they cannot be told. A byte-level
    piece is read with GPT-2's byte map (mlx-lm's, used by byte-level BPE tokenizers:
    Qwen, Llama 3, SmolLM2)."""
    from compat.mlx_lm import byte_decoder

    try:
        piece = tokenizer.convert_ids_to_tokens(token)
    except Exception:
        return None
    if not isinstance(piece, str):
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    table = byte_decoder()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return None


class LogprobFormatter:
    """Turns :class:`TokenEvent` logprobs into OpenAI's chat or completions shape
    (logprobs below :data:`UNLIKELY`, e.g. -inf for tokens a grammar rules out, as UNLIKELY).

    A token that is only part of a character (byte-level BPE splits characters over
    tokens) is written as OpenAI writes such tokens, ``bytes:\\xe4\\xb8``, with its real
    ``bytes``, so that two such tokens never share one text (a completions
    ``top_logprobs`` object is keyed by it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _shown(self, token: int) -> tuple[str, str]:
        """``(how the token is written, its decoded text)``: the text, or, for a token
        whose bytes are not whole UTF-8 characters, ``bytes:\\x..`` (a token that is a
        real U+FFFD keeps its text)."""
        text = self.tokenizer.decode([token])
        if "\ufffd" not in text:
            return text, text
        raw = token_bytes(self.tokenizer, token)
        try:
            if raw is None or raw.decode("utf-8"):
                return text, text
        except UnicodeDecodeError:
            pass
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), text

    def _text(self, token: int) -> str:
        return self._shown(token)[0]

    def _bytes(self, token: int, text: str) -> list[int]:
        raw = token_bytes(self.tokenizer, token) if text.startswith("bytes:") else None
        return list(raw if raw is not None else text.encode())

    def chat_entry(self, ev: TokenEvent) -> dict:
        text = self._text(ev.token)
        return {"token": text, "logprob": _json_logprob(ev.logprob), "bytes": self._bytes(ev.token, text),
                "top_logprobs": [{"token": (t := self._text(i)), "logprob": _json_logprob(lp), "bytes": self._bytes(i, t)}
                                 for i, lp in (ev.top_logprobs or [])]}

    def completion_entries(self, events: list[TokenEvent], offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for ev in events:
            shown, text = self._shown(ev.token)
            tokens.append(shown)
            lps.append(_json_logprob(ev.logprob))
            tops.append({self._text(i): _json_logprob(lp) for i, lp in (ev.top_logprobs or [])})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_completion(rid: str, model: str, content: str, reasoning: str, finish: str, logprobs: Optional[list[dict]],
                    use: dict, tool_calls: Optional[list[dict]] = None) -> dict:
    """A ``chat.completion``; with ``tool_calls``, ``content`` is null when empty."""
    message = {"role": "assistant", "content": content if content or not tool_calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": {"content": logprobs} if logprobs is not None else None, "finish_reason": finish}],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: Optional[str] = None,
               logprobs: Optional[list[dict]] = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                         "finish_reason": finish}]}


def text_completion(rid: str, model: str, text: str, finish: Optional[str], logprobs: Optional[dict],
                    use: Optional[dict], obj_created: Optional[int] = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": obj_created or int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    """The final stream chunk of ``stream_options.include_usage``: no choices, usage set."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
