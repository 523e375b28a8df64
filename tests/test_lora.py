"""LoRA adapters: both file formats, refusals, and rows of different adapters in one batch
giving each request the greedy tokens of mlx-lm's own ``load(BASE, adapter_path=A)`` alone."""

from __future__ import annotations

import functools

import json
import random
import uuid
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from cache import PromptCacheManager
from conftest import EventSink, assert_same_tokens, load, load_model, model_path
from test_speculative import steady_step_cost  # noqa: F401 (a fixture: drafting not left to the machine's load)
from scheduler import Engine, EngineRequest, SamplingParams
from scheduler.lora import MARK, UnknownAdapter, adapters_of
from scheduler.lora.files import AdapterError

TARGETS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]


def targets(model, keys=TARGETS, num_layers: int = -1) -> list[tuple[str, str, int, int]]:
    """``(module path, key, in, out)`` of each linear layer named by ``keys`` in the last
    ``num_layers`` layers (all when -1) of ``model`` (layers lacking one are skipped)."""
    names = {id(m): n for n, m in model.named_modules()}
    layers = list(model.layers)
    found = []
    for layer in layers if num_layers < 0 else layers[-num_layers:]:
        modules = dict(layer.named_modules())
        for k in keys:
            if k in modules and hasattr(modules[k], "weight"):
                out, inp = modules[k].weight.shape
                found.append((f"{names[id(layer)]}.{k}", k, inp, out))
    return found


def write_mlx_lm(path: Path, model, seed: int, rank: int = 4, scale: float = 8.0, dora: bool = False,
                 num_layers: int = -1, keys=TARGETS) -> Path:
    """A random adapter as ``mlx_lm.lora`` writes it (lora_b nonzero, so that it changes tokens)."""
    mx.random.seed(seed)
    weights = {}
    for module, _, inp, out in targets(model, keys, num_layers):
        weights[f"{module}.lora_a"] = mx.random.normal((inp, rank)) * 0.2
        weights[f"{module}.lora_b"] = mx.random.normal((rank, out)) * 0.2
        if dora:
            weights[f"{module}.m"] = mx.random.uniform(0.5, 1.5, (out,))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "dora" if dora else "lora",
        "num_layers": len(model.layers) if num_layers < 0 else num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}}))
    return path


def write_peft(path: Path, model, seed: int, r: int = 4, alpha: float = 16.0) -> tuple[Path, Path]:
    """A random PEFT adapter, and the same adapter in mlx-lm's format (its reference)."""
    mx.random.seed(seed)
    peft, mlx_weights = {}, {}
    for module, _, inp, out in targets(model):
        a, b = mx.random.normal((r, inp)) * 0.3, mx.random.normal((out, r)) * 0.3
        peft[f"base_model.model.{module}.lora_A.weight"] = a
        peft[f"base_model.model.{module}.lora_B.weight"] = b
        mlx_weights[f"{module}.lora_a"] = a.T
        mlx_weights[f"{module}.lora_b"] = b.T
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapter_model.safetensors"), peft)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": "tiny"}))
    ref = path.parent / (path.name + "-as-mlx")
    ref.mkdir(exist_ok=True)
    mx.save_safetensors(str(ref / "adapters.safetensors"), mlx_weights)
    (ref / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": len(model.layers),
        "lora_parameters": {"rank": r, "scale": alpha / r, "dropout": 0.0, "keys": TARGETS}}))
    return path, ref


@functools.lru_cache(maxsize=6)
def reference_model(base: Path, adapter):
    """The model of mlx-lm's own ``load(base, adapter_path=adapter)`` (loaded once per test
    run: a generation keeps no state in the model)."""
    return load_model(base, adapter)


def reference_tokens(base: Path, adapter, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of mlx-lm's own ``load(base, adapter_path=adapter)``, this prompt alone."""
    model = reference_model(base, adapter)
    return [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


def run(engine, jobs: list[tuple[list[int], str | None]], n: int) -> list[list[int]]:
    """Submit ``(prompt, adapter)`` jobs as one burst; each one's greedy tokens."""
    sinks = [EventSink() for _ in jobs]
    with engine.arrivals.prepare():
        for (prompt, adapter), s in zip(jobs, sinks):
            engine.submit(EngineRequest(f"t-{uuid.uuid4().hex[:8]}", prompt, SamplingParams(max_tokens=n), s,
                                        adapter=adapter))
    for s in sinks:
        assert s.done.wait(120), "a request did not finish"
    return [s.tokens for s in sinks]


@pytest.fixture(scope="module")
def qwen3():
    return model_path("qwen3")


def make_adapters(base: Path, root: Path) -> dict:
    """name -> (served path, mlx-lm reference path): two mlx-lm LoRAs (ranks 4 and 8, the
    second on its last layer only), a DoRA and a PEFT LoRA, for the model at ``base``."""
    model = load_model(base)
    a = write_mlx_lm(root / "a", model, 1)
    b = write_mlx_lm(root / "b", model, 2, rank=8, scale=4.0, num_layers=1)
    d = write_mlx_lm(root / "d", model, 3, dora=True)
    p, p_ref = write_peft(root / "p", model, 4)
    return {"a": (a, a), "b": (b, b), "d": (d, d), "p": (p, p_ref)}


@pytest.fixture(scope="module")
def adapters(qwen3, tmp_path_factory):
    return make_adapters(qwen3, tmp_path_factory.mktemp("adapters"))


def make_engine(path: Path, max_loras: int = 8, **kwargs):
    model, tok = load(path)
    adapters_of(model, create=True, max_loras=max_loras, max_rank=16)
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=16, gather_wait=30.0, **kwargs)
    engine.start()
    return engine


def prompts(k: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 900) for _ in range(rng.randrange(5, 30))] for _ in range(k)]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3_text", "qwen3_5"])
def test_each_adapter_and_the_base_alone_and_mixed_equal_mlx_lm_alone(arch, tmp_path):
    base = model_path(arch)
    adapters = make_adapters(base, tmp_path)
    n = 8
    names = [None, "a", "b", "d", "p"]
    ps = prompts(len(names) * 2)
    jobs = [(p, names[i % len(names)]) for i, p in enumerate(ps)]
    want = [reference_tokens(base, None if a is None else adapters[a][1], p, n) for p, a in jobs]
    base_of = {tuple(p): reference_tokens(base, None, p, n) for p, _ in jobs}
    assert all(w != base_of[tuple(p)] for w, (p, a) in zip(want, jobs) if a), "an adapter changes no token"
    engine = make_engine(base)
    try:
        lora = adapters_of(engine.model)
        for name in names[1:]:
            engine.call(lambda name=name: lora.load(name, str(adapters[name][0])))
        for job, w in zip(jobs, want):  # alone
            engine.flush_cache()
            assert run(engine, [job], n) == [w], f"adapter {job[1]} alone"
        engine.flush_cache()
        assert run(engine, jobs, n) == want, "mixed in one batch"
        assert run(engine, jobs, n) == want, "mixed again, from the prefix cache"
    finally:
        engine.stop()


def reference_logprobs(base: Path, adapter, prompt: list[int], n: int) -> list[tuple[int, float]]:
    """``(token, logprob)`` of mlx-lm's own greedy generation with the adapter, this prompt alone."""
    model = reference_model(base, adapter)
    return [(int(t), lp[int(t)].item()) for (t, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n),
                                                              range(n))]


def test_logprobs_mixed_in_one_batch_equal_mlx_lm_alone(qwen3, adapters):
    n = 6
    jobs = [(p, a) for p, a in zip(prompts(5, seed=21), [None, "a", "b", "d", "p"])]
    want = [reference_logprobs(qwen3, None if a is None else adapters[a][1], p, n) for p, a in jobs]
    engine = make_engine(qwen3)
    try:
        lora = adapters_of(engine.model)
        for name in ("a", "b", "d", "p"):
            engine.call(lambda name=name: lora.load(name, str(adapters[name][0])))
        sinks = [EventSink() for _ in jobs]
        with engine.arrivals.prepare():
            for (p, a), s in zip(jobs, sinks):
                engine.submit(EngineRequest(f"l-{uuid.uuid4().hex[:6]}", p, SamplingParams(max_tokens=n, logprobs=True),
                                            s, adapter=a))
        for s, w, (_, a) in zip(sinks, want, jobs):
            assert s.done.wait(120)
            got = [(e.token, e.logprob) for e in s.events if type(e).__name__ == "TokenEvent"]
            assert_same_tokens(got, w, f"adapter {a}")
    finally:
        engine.stop()


def test_the_same_prompt_under_two_adapters_shares_no_kv(qwen3, adapters):
    engine = make_engine(qwen3)
    try:
        lora = adapters_of(engine.model)
        engine.call(lambda: lora.load("a", str(adapters["a"][0])))
        engine.call(lambda: lora.load("p", str(adapters["p"][0])))
        p = prompts(1, seed=3)[0]
        run(engine, [(p, "a")], 4)
        sink = EventSink()
        engine.submit(EngineRequest("x", p, SamplingParams(max_tokens=4), sink, adapter="p"))
        assert sink.done.wait(60)
        assert sink.events[0].cached_tokens == 0
        ns = [n for n in engine.prompt_cache._groups]
        assert any(MARK in n and "a#" in n for n in ns) and any("p#" in n for n in ns), ns
        # the adapters' namespaces count in the request's cache group (and stay off the disk tier)
        assert all(engine.prompt_cache.eviction.quota_key(n) == "default" for n in ns)
        assert all(n in engine.prompt_cache.eviction.owners for n in ns if MARK in n)
        assert sink.tokens == reference_tokens(qwen3, adapters["p"][1], p, 4)
    finally:
        engine.stop()


def test_unload_then_unknown_then_load_again_and_lru(qwen3, adapters):
    engine = make_engine(qwen3, max_loras=2)
    try:
        lora = adapters_of(engine.model)
        p = prompts(1, seed=5)[0]
        engine.call(lambda: lora.load("a", str(adapters["a"][0])))
        first = run(engine, [(p, "a")], 5)
        engine.call(lambda: lora.unload("a"))
        with pytest.raises(UnknownAdapter):
            engine.submit(EngineRequest("u", p, SamplingParams(max_tokens=2), EventSink(), adapter="a"))
        assert run(engine, [(p, None)], 5) == [reference_tokens(qwen3, None, p, 5)]
        engine.call(lambda: lora.load("a", str(adapters["a"][0])))
        assert run(engine, [(p, "a")], 5) == first
        engine.call(lambda: lora.load("b", str(adapters["b"][0])))
        engine.call(lambda: lora.load("d", str(adapters["d"][0])))  # two slots: "a" (idle, oldest) goes
        assert sorted(lora.resident_names()) == ["b", "d"]
        engine.call(lambda: lora.load("a", str(adapters["a"][0])))  # read again, "b" goes
        assert sorted(lora.resident_names()) == ["a", "d"]
        assert run(engine, [(p, "a")], 5) == first
    finally:
        engine.stop()


def test_adapter_switches_for_days_leave_no_namespaces_behind(qwen3, adapters):
    """Each load of an adapter has its own prefix-cache namespace (``#serial``); once the
    adapter has left its slot, that namespace (its snapshots, tree and companion link) goes,
    so switching between two adapters on one slot keeps a bounded cache, where before every
    load's snapshots stayed until evicted."""
    engine = make_engine(qwen3, max_loras=1)
    try:
        lora, cache, p = adapters_of(engine.model), engine.prompt_cache, prompts(1, seed=9)[0]
        for name in "abababab":
            engine.call(lambda: lora.load(name, str(adapters[name][0])))
            run(engine, [(p, name)], 3)
        adapter_spaces = [ns for ns in cache.namespaces() if MARK in ns]
        assert len(adapter_spaces) <= 2, adapter_spaces  # the resident one's, the last one's until the next load
        assert len(cache.eviction.owners) <= 2, cache.eviction.owners
        assert len([ns for ns in cache._groups if MARK in ns]) <= 2
        assert run(engine, [(p, "b")], 3) == [reference_tokens(qwen3, adapters["b"][1], p, 3)]
        cache.sanity_check()
    finally:
        engine.stop()


def test_refused_adapters_name_what_does_not_fit_and_leave_nothing(qwen3, adapters, tmp_path):
    model = load_model(qwen3)
    lora = adapters_of(model, create=True, max_rank=4)
    cases = {"rank 8 is over the limit of 4": adapters["b"][0], "no adapter_config.json": tmp_path}
    wider = write_mlx_lm(tmp_path / "wider", model, 9, keys=["mlp.down_proj"])  # a base with 256 MLP features
    w = mx.load(str(wider / "adapters.safetensors"))
    w["model.layers.1.mlp.down_proj.lora_a"] = mx.zeros((256, 4))
    mx.save_safetensors(str(wider / "adapters.safetensors"), w)
    cases["down_proj: the adapter maps 256 -> 64 features, this model's layer 128 -> 64"] = wider
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    cases["not valid JSON"] = bad
    alien = write_mlx_lm(tmp_path / "alien", model, 9, keys=["self_attn.q_proj"])
    w = mx.load(str(alien / "adapters.safetensors"))
    w["model.layers.0.block.wq.lora_a"] = w.pop("model.layers.0.self_attn.q_proj.lora_a")
    mx.save_safetensors(str(alien / "adapters.safetensors"), w)
    cases["block.wq"] = alien
    peft, _ = write_peft(tmp_path / "peft", model, 9)
    (peft / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "use_dora": True}))
    cases["PEFT DoRA"] = peft
    for message, path in cases.items():
        with pytest.raises(AdapterError, match=message):
            lora.load("x", str(path))
        assert lora.names() == {} and not any(type(m).__name__ == "MultiLoraLinear" for _, m in model.named_modules())


def test_files_read_as_numpy_off_the_engine_thread_give_the_same_adapter(qwen3, tmp_path):
    """:func:`read_files` (no MLX: any thread) reads bfloat16 tensors bit for bit; a
    truncated file is refused, naming it."""
    import numpy as np

    from scheduler.lora.files import check_adapter, read_files

    model = load_model(qwen3)
    path = write_mlx_lm(tmp_path / "bf16", model, 5)
    w = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(path / "adapters.safetensors")).items()}
    mx.save_safetensors(str(path / "adapters.safetensors"), w)
    files = read_files(str(path))
    assert files.bfloat16 == set(w) and all(isinstance(t, np.ndarray) for t in files.tensors.values())
    got = check_adapter(files, model, 16)
    assert len(got.layers) * 2 == len(w)
    for module, u in got.layers.items():
        assert u.a.dtype == mx.bfloat16 and mx.array_equal(u.a, w[f"{module}.lora_a"]).item()
        assert mx.array_equal(u.b, w[f"{module}.lora_b"]).item()
    data = (path / "adapters.safetensors").read_bytes()
    (path / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="bf16/adapters.safetensors is not a readable safetensors file"):
        read_files(str(path))


def test_peft_names_of_hugging_face_qwen3_5_map_to_mlx_lm_layers(tmp_path):
    """A PEFT adapter trained on Hugging Face's Qwen3.5 names ``model.language_model.layers``
    (mlx-lm's port: ``language_model.model.layers``); it is read onto the same layers as the
    adapter under mlx-lm's names, factor for factor."""
    from scheduler.lora.files import check_adapter, read_files

    base = model_path("qwen3_5")
    model = load_model(base)
    mlx_named, _ = write_peft(tmp_path / "mlx-names", model, 4)
    w = mx.load(str(mlx_named / "adapter_model.safetensors"))
    hf = tmp_path / "hf-names"
    hf.mkdir()
    mx.save_safetensors(str(hf / "adapter_model.safetensors"), {
        k.replace("base_model.model.language_model.model.", "base_model.model.model.language_model."): v
        for k, v in w.items()})
    (hf / "adapter_config.json").write_text((mlx_named / "adapter_config.json").read_text())
    assert all(".model.language_model." in k for k in mx.load(str(hf / "adapter_model.safetensors")))
    want, got = (check_adapter(read_files(str(d)), model, 16) for d in (mlx_named, hf))
    assert set(got.layers) == set(want.layers) and len(got.layers) > 0
    for module, u in got.layers.items():
        assert mx.array_equal(u.a, want.layers[module].a).item() and u.scale == want.layers[module].scale


def test_a_byte_room_unloads_idle_adapters_or_refuses_leaving_the_rest(qwen3, adapters):
    from scheduler.lora import AdapterNoRoom
    from scheduler.lora.files import read_files

    engine = make_engine(qwen3)
    try:
        lora = adapters_of(engine.model)
        one = read_files(str(adapters["a"][0])).nbytes  # "p" is as large (rank 4, the same layers)
        engine.call(lambda: lora.load("a", str(adapters["a"][0]), room=4 * one))
        assert 3 * one <= lora.nbytes < 3.1 * one  # its factors, their stacked copy, slot 0's zeros
        engine.call(lambda: lora.load("p", str(adapters["p"][0]), room=4 * one))  # "a", idle, makes room
        assert lora.resident_names() == ["p"] and set(lora.names()) == {"a", "p"}
        with pytest.raises(AdapterNoRoom, match="the memory budget leaves them"):
            engine.call(lambda: lora.load("a", str(adapters["a"][0]), room=one))
        assert lora.resident_names() == ["p"]
        p = prompts(1, seed=7)[0]
        assert run(engine, [(p, "p")], 4) == [reference_tokens(qwen3, adapters["p"][1], p, 4)]
    finally:
        engine.stop()


def test_a_quantized_base_alone_and_mixed_equals_mlx_lm(qwen3, adapters, tmp_path):
    from mlx_lm import convert

    q = tmp_path / "q4"
    convert(str(qwen3), mlx_path=str(q), quantize=True, q_group_size=32, q_bits=4)
    for f in qwen3.iterdir():  # the tokenizer files convert did not copy
        if not (q / f.name).exists() and f.is_file():
            (q / f.name).write_bytes(f.read_bytes())
    n = 6
    jobs = [(p, name) for p, name in zip(prompts(6, seed=7), [None, "a", "d", "p", "a", None])]
    want = [reference_tokens(q, None if a is None else adapters[a][1], p, n) for p, a in jobs]
    engine = make_engine(q)
    try:
        lora = adapters_of(engine.model)
        assert type(dict(engine.model.named_modules())["model.layers.0.self_attn.q_proj"]).__name__ == "QuantizedLinear"
        for name in ("a", "d", "p"):
            engine.call(lambda name=name: lora.load(name, str(adapters[name][0])))
        assert run(engine, jobs, n) == want
    finally:
        engine.stop()


def test_ngram_speculation_verifies_each_row_under_its_own_adapter(qwen3, adapters, steady_step_cost):  # noqa: F811 (the fixture)
    """Repetitive prompts, so that prompt lookup drafts: each row's verify forward applies
    its own adapter, and the greedy tokens stay mlx-lm's."""
    from scheduler.speculative import SpeculationConfig

    from test_speculative import _workload

    ps, _ = _workload(1)
    jobs = list(zip(ps, ["a", None, "p", "d", "a"]))
    n = 30
    want = [reference_tokens(qwen3, None if a is None else adapters[a][1], p, n) for p, a in jobs]
    engine = make_engine(qwen3, speculation=SpeculationConfig("ngram", num_draft_tokens=4))
    try:
        lora = adapters_of(engine.model)
        for name in ("a", "p", "d"):
            engine.call(lambda name=name: lora.load(name, str(adapters[name][0])))
        assert run(engine, jobs, n) == want
        s = engine.stats.speculation
        assert s.verify_steps > 0 and 0 < s.accepted < s.drafted, s  # drafts were taken and refused
    finally:
        engine.stop()


def test_a_long_prompt_joining_apart_and_chunked_keeps_its_adapter(qwen3, adapters, monkeypatch):
    """Short rows decode under their adapters; a long prompt under another one arrives,
    prefills in chunks beside them and joins apart (its first token from a forward of its
    own: scheduler.batch.generator.APART_WIDTH); every row keeps mlx-lm's tokens."""
    from scheduler.batch.generator import JoiningBatchGenerator

    apart = []
    join_apart = JoiningBatchGenerator._join_apart
    monkeypatch.setattr(JoiningBatchGenerator, "_join_apart",
                        lambda self, moving, last: (apart.append(list(moving.uids)), join_apart(self, moving, last)))
    rng = random.Random(13)
    short = [([rng.randrange(10, 900) for _ in range(8)], a) for a in ("a", None, "p")]
    long_job = ([rng.randrange(10, 900) for _ in range(300)], "d")
    n = 24
    want = [reference_tokens(qwen3, None if a is None else adapters[a][1], p, n) for p, a in short + [long_job]]
    model, tok = load(qwen3)
    lora = adapters_of(model, create=True, max_rank=16)
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=16, prefill_step_size=64, gather_wait=30.0)
    engine.start()
    try:
        for name in ("a", "p", "d"):
            engine.call(lambda name=name: lora.load(name, str(adapters[name][0])))
        sinks = [EventSink() for _ in range(4)]
        with engine.arrivals.prepare():
            for (p, a), s in zip(short, sinks):
                engine.submit(EngineRequest(f"s-{uuid.uuid4().hex[:6]}", p, SamplingParams(max_tokens=n), s, adapter=a))
        while min(len(s.tokens) for s in sinks[:3]) < 2:
            sinks[0].done.wait(0.005)
        engine.submit(EngineRequest("long", long_job[0], SamplingParams(max_tokens=n), sinks[3], adapter="d"))
        for s in sinks:
            assert s.done.wait(120)
        assert [s.tokens for s in sinks] == want
        assert apart, "the long prompt did not join apart"
    finally:
        engine.stop()
