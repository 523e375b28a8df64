"""Build tiny random-weight models of real architectures, loadable by ``mlx_lm.load``.

The demo model lets ``mlx-gateway serve`` start on a machine without a model hub, and
lets tests and benchmarks exercise the real loading, cache and batching code paths
for several cache types (``KVCache``, ``RotatingKVCache``, ``ArraysCache``).

A model directory holds ``config.json``, ``model.safetensors`` (float32 random
weights) and tokenizer files. The tokenizer is either the project's own byte-level
BPE with a ChatML template that handles ``<think>`` blocks, or the files of a real
tokenizer directory (for example a Qwen3 or Llama 3.2 tokenizer without weights).
The weights are random: the model's output is random text.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
from pathlib import Path


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

# ChatML with Qwen3-style thinking and tools: the tools are described in the system turn
# (so a conversation's prefix does not change when it grows), calls are
# ``<tool_call>{"name", "arguments"}</tool_call>`` blocks (mlx-lm's json_tools parser reads
# them), results go back as ``<tool_response>`` blocks in a user turn. Reasoning of earlier
# assistant turns is dropped; `enable_thinking=False` pre-fills an empty think block.
CHAT_TEMPLATE = (
    "{%- set first_system = messages and messages[0]['role'] == 'system' %}"
    "{%- macro text(content) %}{%- if content is string %}{{- content }}{%- else %}"
    "{{- content | map(attribute='text') | join('') }}{%- endif %}{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if first_system %}{{- text(messages[0]['content']) + '\\n\\n' }}{%- endif %}"
    "{{- 'Functions you may call, one JSON description per line:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nTo call one, write <tool_call>\\n{\"name\": <name>, \"arguments\": <arguments object>}\\n'"
    " + '</tool_call>.<|im_end|>\\n' }}"
    "{%- elif first_system %}"
    "{{- '<|im_start|>system\\n' + text(messages[0]['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = text(message['content']) if message['content'] is not none else '' %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content }}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set tool_call = tool_call['function'] if tool_call.get('function') else tool_call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}"
    "{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

_CORPUS_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one "
    "have this from or had by hot word but what some we can out other were all there when "
    "up use your how said each she which do their time if will way about many then them "
    "write would like so these her long make thing see him two has look more day could go "
    "come did number sound no most people my over know water than call first who may down "
    "side been now find any new work part take get place made live where after back little "
    "only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right "
    "boy old too same tell does set three want air well also play small end put home read "
    "hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world "
    "model cache token prompt server batch request tenant prefix memory metal apple code "
    "agent browser extension stream answer question system user assistant reason think"
).split()

# Tiny configurations of real architectures. Hidden sizes are small so that the
# CPU backend runs them fast; layer mixes keep every cache type represented.
ARCH_CONFIGS: dict[str, dict] = {
    "qwen3": {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "tie_word_embeddings": True,
    },
    "llama": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
        "rope_theta": 500000.0, "tie_word_embeddings": True,
    },
    "qwen3_5": {
        "model_type": "qwen3_5", "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 16, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 16,
        "sliding_window": 64, "sliding_window_pattern": 2,
        "max_position_embeddings": 32768,
    },
    "mamba2": {
        "model_type": "mamba2", "num_heads": 4, "head_dim": 16, "hidden_size": 32,
        "intermediate_size": 64, "state_size": 16, "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5, "conv_kernel": 4, "n_groups": 1,
        "use_bias": False, "use_conv_bias": True, "tie_word_embeddings": True,
        "time_step_limit": [0.0, 1e9], "time_step_rank": "auto",
    },
    "nemotron_h": {
        "model_type": "nemotron_h", "hidden_size": 64, "intermediate_size": 128,
        "max_position_embeddings": 32768, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
        "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
        "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False,
        "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "*", "-"], "tie_word_embeddings": True,
        "time_step_limit": [0.0, 1e9],
    },
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "added_tokens.json", "chat_template.jinja")


def all_archs() -> list[str]:
    """Every architecture :func:`build_model_dir` builds."""
    from gateway.models.demo_multimodal import EMBEDDING_CONFIGS, VISION_CONFIGS
    from gateway.models.demo_qwen_vl import QWEN_VL_CONFIGS

    return sorted({*ARCH_CONFIGS, *VISION_CONFIGS, *EMBEDDING_CONFIGS, *QWEN_VL_CONFIGS})


def default_demo_dir() -> Path:
    """Where ``serve`` keeps its demo model: ``$MLX_GATEWAY_HOME`` or ``~/.cache/mlx-gateway``."""
    home = os.environ.get("MLX_GATEWAY_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "mlx-gateway"
    return base / "demo-qwen3"


def _corpus(n_sentences: int = 4000, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        words = rng.choices(_CORPUS_WORDS, k=rng.randint(4, 14))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def _write_own_tokenizer(path: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on a generated corpus; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 32768,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy a real tokenizer's files from ``src`` into the existing directory ``dst``.

    A file may be stored xz-compressed as ``NAME.xz`` (e.g. ``tokenizer.json.xz``); it is
    written decompressed as ``NAME``. Where both exist, the plain file is taken. Returns the
    names written.
    """
    written = []
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
        elif (src / f"{name}.xz").exists():
            (dst / name).write_bytes(lzma.decompress((src / f"{name}.xz").read_bytes()))
        else:
            continue
        written.append(name)
    return written


def _copy_tokenizer(src: Path, dst: Path) -> int:
    """Copy a real tokenizer's files (decompressing ``*.xz``); returns its vocabulary size."""
    from tokenizers import Tokenizer

    copy_tokenizer_files(src, dst)
    return Tokenizer.from_file(str(dst / "tokenizer.json")).get_vocab_size()


def build_model_dir(path: str | os.PathLike, arch: str = "qwen3", tokenizer_dir: str | os.PathLike | None = None,
                    vocab_size: int | None = None, seed: int = 0, overrides: dict | None = None) -> Path:
    """Write a tiny random-weight model directory for ``arch``, idempotently.

    Args:
        path: the directory to create. If it already holds a finished model built
            with the same arguments, nothing is rewritten.
        arch: a key of :data:`ARCH_CONFIGS` (an ``mlx_lm.models`` module name), or a
            vision-language or embedding architecture of
            :mod:`gateway.models.demo_multimodal` (``gemma3``, ``qwen3_embedding``) or
            :mod:`gateway.models.demo_qwen_vl` (``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_5_vl``):
            they need mlx-vlm or mlx-embeddings, and a real tokenizer directory.
        tokenizer_dir: a directory with real tokenizer files to copy; by default
            the project's own byte-level BPE (about 1,000 tokens) is trained.
        vocab_size: the embedding rows; defaults to the tokenizer's size rounded
            up to a multiple of 64 (a real family's ``vocab_size`` may be larger).
        seed: the random seed of the weights.
        overrides: config entries replacing those of :data:`ARCH_CONFIGS` (e.g. a
            larger ``hidden_size`` for benchmarks).

    Returns:
        The directory path.

    Raises:
        ValueError: for an unknown architecture.
        gateway.models.demo_multimodal.TokenizerNeeded: (a ValueError) for a vision
            architecture without a tokenizer of its family (``gemma3``: Gemma 3's; the Qwen
            vision models: a Qwen one with ``<|image_pad|>``); nothing
            is written.
    """
    import importlib

    import mlx.core as mx
    import mlx.utils

    from gateway.models.demo_multimodal import check_tokenizer
    from gateway.models.demo_qwen_vl import CHAT_TEMPLATE as QWEN_VL_TEMPLATE, QWEN_VL_CONFIGS

    if tokenizer_dir is None:
        check_tokenizer(arch, None, vocab_size or 0)
    if arch not in all_archs():
        raise ValueError(f"unknown architecture {arch!r}; choose from {sorted(all_archs())}")
    path = Path(path)
    stamp = {"arch": arch, "tokenizer": str(tokenizer_dir), "vocab": vocab_size, "seed": seed,
             "overrides": overrides or {}, "template": hashlib.sha256((CHAT_TEMPLATE + "".join(SPECIAL_TOKENS)).encode()).hexdigest()[:12]}
    if arch in QWEN_VL_CONFIGS:  # their own config and template: a change to either rebuilds
        stamp["qwen_vl"] = hashlib.sha256((json.dumps(QWEN_VL_CONFIGS[arch]) + QWEN_VL_TEMPLATE).encode()
                                          ).hexdigest()[:12]
    done = path / ".mlx-gateway-demo.json"
    if done.exists() and json.loads(done.read_text()) == stamp:
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    if tokenizer_dir is None:
        n_vocab = _write_own_tokenizer(tmp, vocab_size=1024)
    else:
        n_vocab = _copy_tokenizer(Path(tokenizer_dir), tmp)
    vocab = vocab_size or -(-n_vocab // 64) * 64
    if arch not in ARCH_CONFIGS:  # a vision-language or embedding model (gateway.models.demo_multimodal)
        from gateway.models.demo_multimodal import write_multimodal

        try:
            check_tokenizer(arch, tmp / "tokenizer.json", vocab)
        except ValueError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        mx.random.seed(seed)
        write_multimodal(tmp, arch, vocab, overrides or {})
        (tmp / ".mlx-gateway-demo.json").write_text(json.dumps(stamp))
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)
        return path

    config = dict(ARCH_CONFIGS[arch], **(overrides or {}), vocab_size=vocab)
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    params = dict(mlx.utils.tree_flatten(model.parameters()))
    # Matrices ~ N(0, 1/fan_in), as in common initialisations: activations stay O(1),
    # so the output depends visibly on every layer (and on every cache) of the model.
    params = {
        k: (mx.random.normal(v.shape) * v.shape[-1] ** -0.5 if v.ndim > 1 else v).astype(mx.float32)
        for k, v in params.items()
    }
    mx.save_safetensors(str(tmp / "model.safetensors"), params)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / ".mlx-gateway-demo.json").write_text(json.dumps(stamp))

    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path
