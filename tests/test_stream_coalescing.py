"""A reader behind the engine gets the tokens at hand merged: one piece per run of tokens
of the same kind, every token (and its logprob) in it, the same text (real engine,
tiny model, real tokenizer)."""

import asyncio

import mlx_lm

from cache import PromptCacheManager
from conftest import model_path
from gateway.conversation.form import Piece
from gateway.conversation.generation import Generation
from gateway.conversation.run import Run
from gateway.conversation.textout import TextAssembler
from scheduler import Engine, SamplingParams
from scheduler.request import DoneEvent
from scheduler.speculative import SpeculationConfig


class CountingBooks:
    """The books a run tells its tokens and its end to (counted here)."""

    def __init__(self):
        self.tokens, self.ended = 0, None

    def token(self):
        self.tokens += 1

    def end(self, reason, status=None):
        self.ended = reason

    def prompt_read(self, ev):
        pass


def test_a_reader_behind_the_engine_gets_merged_pieces_with_every_token():
    model, tok = mlx_lm.load(str(model_path("qwen3")))
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(max_bytes=1 << 28, max_entries=4),
                    speculation=SpeculationConfig(method="off"))
    engine.start()
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=True)

    async def pieces(behind: bool, n: int):
        gen = Generation(f"coalesce-{n}", engine, [5, 17, 99, 3, 250, 41, 8], params, [])
        gen.submit()
        while behind and not any(isinstance(e, DoneEvent) for b in list(gen._buffer) for e in b):
            await asyncio.sleep(0.01)  # every token at hand before the first read
        books = CountingBooks()
        out = [p async for p in Run(None, None, gen, TextAssembler(tok), books)._pieces() if isinstance(p, Piece)]
        return out, books

    try:
        eager, eager_books = asyncio.run(pieces(False, 0))
        late, late_books = asyncio.run(pieces(True, 1))
    finally:
        engine.stop()
    tokens = lambda ps: [(t.token, t.logprob) for p in ps for t in p.tokens]
    assert len(tokens(eager)) == 16 and tokens(late) == tokens(eager)
    assert "".join(p.text for p in late) == "".join(p.text for p in eager)
    assert late_books.tokens == eager_books.tokens == 16 and late_books.ended == eager_books.ended == "length"
    assert len(late) < len(eager)
    kinds = [(p.text > "", p.reasoning > "") for p in late]
    assert all(a != b for a, b in zip(kinds, kinds[1:]))  # merged wherever two neighbours were of one kind
