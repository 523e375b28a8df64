"""``response_format`` over HTTP with the openai SDK: constrained rows always parse and
validate, share batches with free and tool rows without changing anyone's tokens, and a
grammar failure fails its own request only."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from conftest import EventSink, live_server, model_path
from gateway.conversation.form import Conversation
from gateway.conversation.structured import output_mask
from scheduler import EngineRequest, SamplingParams
from scheduler.request import ErrorEvent
from test_tools_api import TOOLS, calls_of

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                               "y": {"type": "integer", "minimum": -9, "maximum": 9}},
              "required": ["x", "y"], "additionalProperties": False},
    "kind": {"anyOf": [{"const": "dot"}, {"type": "null"}]}},
    "required": ["point", "kind"], "additionalProperties": False}


def schema_format(schema, name="out"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module", params=[("qwen3", "qwen3"), ("qwen3", None)], ids=["qwen3-tokenizer", "own-bpe"])
def server(request):
    with live_server(model_path(*request.param), max_tokens=64) as s:
        yield s


def ask(client, prompt: str, stream: bool = False, **body) -> tuple[str, str]:
    kw = dict(model="test-model", messages=[{"role": "user", "content": prompt}], **{"max_tokens": 100, **body})
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("schema", [PERSON, NESTED], ids=["person", "nested"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_json_schema_output_parses_and_validates(server, schema, stream):
    client = server.openai()
    for prompt in ("Describe someone.", "Where is the point?", "x"):
        text, finish = ask(client, prompt, stream, response_format=schema_format(schema))
        assert finish == "stop", text  # a bounded schema always finishes
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_logprobs_of_a_constrained_answer_are_json_numbers(server, stream):
    """Where the grammar allows fewer tokens than ``top_logprobs`` asks for, the others
    have -inf, which JSON cannot carry: they come as OpenAI's -9999.0 (very unlikely)."""
    kw = dict(model="test-model", messages=[{"role": "user", "content": "Describe someone."}], max_tokens=100,
              temperature=0, response_format=schema_format(PERSON), logprobs=True, top_logprobs=5)
    if stream:
        entries = [e for c in server.openai().chat.completions.create(stream=True, **kw)
                   if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        entries = server.openai().chat.completions.create(**kw).choices[0].logprobs.content
    tops = [t.logprob for e in entries for t in e.top_logprobs]
    assert entries and all(-9999.0 <= e.logprob <= 0 for e in entries)
    assert all(-9999.0 <= lp <= 0 for lp in tops)
    assert -9999.0 in tops  # some step allowed fewer than 5 tokens (e.g. a '"' or a ':')


def test_json_object_output_is_an_object(server):
    client = server.openai()
    for prompt in ("Reply in JSON.", "Another one", "{"):
        text, finish = ask(client, prompt, response_format={"type": "json_object"}, max_tokens=200)
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # ran out of tokens: what came is still the start of an object
            assert text.startswith("{")


def test_mixed_batch_equals_solo_runs(server):
    """Constrained, free and tool rows decoded in one batch give the tokens each gives alone."""
    client = server.openai()
    jobs = [
        dict(prompt="Describe someone.", response_format=schema_format(PERSON)),
        dict(prompt="Tell me a story about the sea and the wind.", max_tokens=40),
        dict(prompt="Where is the point?", response_format=schema_format(NESTED)),
        dict(prompt="Add two numbers.", tools=TOOLS, tool_choice="required"),
        dict(prompt="Weather?", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}),
        dict(prompt="Just talk to me for a while.", max_tokens=40),
        dict(prompt="JSON please", response_format={"type": "json_object"}, max_tokens=30),
    ]

    def run(job):
        job = dict(job)
        r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": job.pop("prompt")}],
                                           **{"max_tokens": 100, **job})
        c = r.choices[0]
        return c.message.content, calls_of(c.message), c.finish_reason, r.usage.completion_tokens

    server.engine.prompt_cache.eviction.flush(None)
    solo = [run(j) for j in jobs]
    server.engine.prompt_cache.eviction.flush(None)
    assert server.engine.wait_idle()
    server.engine.stats.max_decode_batch = 0  # written by the engine between steps only; it is idle
    barrier = threading.Barrier(len(jobs))

    def together(job):
        barrier.wait()
        return run(job)

    with ThreadPoolExecutor(len(jobs)) as pool:
        batched = list(pool.map(together, jobs))
    assert batched == solo
    assert server.engine.stats.max_decode_batch >= 3


BAD = [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "bad name", "schema": PERSON}},
     "response_format.json_schema.name"),
    (schema_format({"type": "nope"}), "response_format.json_schema.schema"),
    (schema_format({"type": "object", "required": "a"}), "response_format.json_schema.schema"),
    (schema_format({"type": "string", "pattern": "(?<=a)b"}), "response_format.json_schema.schema"),
    (schema_format({"$ref": "#/$defs/missing"}), "response_format.json_schema.schema"),
    ("json", "response_format"),
]


@pytest.mark.parametrize("fmt, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_response_format_gets_a_400_naming_the_parameter(server, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        ask(server.openai(), "hi", response_format=fmt)
    assert e.value.body["param"] == param, e.value.body
    assert server.engine.alive


@pytest.mark.parametrize("keyword", [{"uniqueItems": True}, {"contains": {"const": 1}}])
def test_a_keyword_the_grammar_cannot_enforce_is_a_400_naming_it(server, keyword):
    """Never silently ignored: the answer could break the schema."""
    fmt = schema_format({"type": "array", "items": {"type": "integer"}, **keyword})
    with pytest.raises(openai.BadRequestError) as e:
        ask(server.openai(), "hi", response_format=fmt)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert next(iter(keyword)) in e.value.body["message"], e.value.body


class BrokenMatcher:
    """A real llguidance matcher that raises on its ``fail_at``-th token (fault injection)."""

    def __init__(self, matcher, fail_at: int):
        self._m, self._left = matcher, fail_at

    def consume_token(self, token):
        self._left -= 1
        if self._left <= 0:
            raise RuntimeError("injected grammar fault")
        return self._m.consume_token(token)

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_a_grammar_failure_fails_only_its_request(server):
    state, engine = server.model, server.engine
    fmt = Conversation([], output_schema=PERSON)
    prompt = list(range(20, 60))

    def run_alone(mask):
        c = EventSink()
        engine.submit(EngineRequest(f"solo-{id(c)}", prompt, SamplingParams(max_tokens=60), c, mask=mask))
        assert c.done.wait(60)
        return c

    free_solo = run_alone(None)
    good_solo = run_alone(output_mask(state.grammars, fmt, None))
    broken_mask = output_mask(state.grammars, fmt, None)
    broken_mask.matcher = BrokenMatcher(broken_mask.matcher, fail_at=3)
    collectors = {"free": EventSink(), "good": EventSink(), "broken": EventSink()}
    masks = {"free": None, "good": output_mask(state.grammars, fmt, None), "broken": broken_mask}
    for name, c in collectors.items():
        engine.submit(EngineRequest(f"mix-{name}", prompt, SamplingParams(max_tokens=60), c, mask=masks[name]))
    for c in collectors.values():
        assert c.done.wait(60)
    broken = collectors["broken"]
    assert isinstance(broken.events[-1], ErrorEvent) and "injected grammar fault" in broken.events[-1].message
    assert len(broken.tokens) <= 3
    assert collectors["free"].tokens == free_solo.tokens
    assert collectors["good"].tokens == good_solo.tokens
    jsonschema.validate(json.loads(state.tokenizer.decode(good_solo.tokens[:-1])), PERSON)
    assert engine.alive
    text, finish = ask(server.openai(), "still fine?", response_format=schema_format(PERSON))
    assert finish == "stop" and json.loads(text)


def test_models_on_one_tokenizer_share_one_vocabulary_index_equal_to_llguidances_own():
    """``scheduler.grammar.vocabulary_index``: the index ``llguidance.hf.from_tokenizer`` builds
    (same tokens, eos and masks), shared by the grammars of every model whose tokenizer
    serializes the same, with the same logits and eos ids, while one of them lives; another
    ``n_vocab`` or eos gets its own."""
    import gc

    import llguidance
    import llguidance.hf

    from conftest import TOKENIZERS, load_tokenizer
    from scheduler import grammar
    from scheduler.grammar import Grammars, json_schema_grammar

    a, b = load_tokenizer(TOKENIZERS / "qwen3"), load_tokenizer(model_path("qwen3", "qwen3"))
    assert a is not b  # two loads of the same tokenizer files (the model's config adds an eos id)
    n, eos = 151936, sorted(a.eos_token_ids)
    first = Grammars(a._tokenizer, n, eos)
    ours = first._tokenizer()
    assert Grammars(b._tokenizer, n, eos)._tokenizer() is ours
    assert Grammars(a._tokenizer, n + 64, eos)._tokenizer() is not ours
    assert Grammars(a._tokenizer, n, [0])._tokenizer() is not ours
    theirs = llguidance.hf.from_tokenizer(a._tokenizer, n_vocab=n, eos_token=eos)
    assert (ours.vocab_size, ours.eos_tokens) == (theirs.vocab_size, theirs.eos_tokens)
    text = 'héllo <think> {"a": [1, 2.5e3]} <tool_call> 世界'
    assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    schema = json_schema_grammar({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    mine, reference = llguidance.LLMatcher(ours, schema), llguidance.LLMatcher(theirs, schema)
    for token in [*a.encode('{"a":"x y"}', add_special_tokens=False), *eos]:
        assert mine.compute_bitmask() == reference.compute_bitmask()
        assert mine.consume_token(token) and reference.consume_token(token)
    assert mine.is_stopped() and reference.is_stopped()
    del first, ours, mine
    gc.collect()
    assert not any(g._hf is a._tokenizer for g in grammar._indexes.values())  # kept by no one: gone
