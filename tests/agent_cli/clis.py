"""How each agent CLI is set up and driven headless, as a user would: its own config files
and environment under an isolated HOME, two turns of one session (the second continues
the first), and where its answer is in what it prints.

Every CLI talks to ``base`` (the recording proxy in front of the gateway) as model
``test-model``, with its own built-in tools in the prompt. Nothing else is reachable:
:func:`offline_env` points proxy-aware clients at a proxy that refuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MODEL = "test-model"
KEY = "sk-test-agent-key"  # the fake API key every CLI sends (the gateway runs without keys)
MAX_OUTPUT = 48  # output-token cap, where a CLI lets one set it
PROMPTS = ("List the files in this directory.", "Which of them is the largest?")


@dataclass(frozen=True)
class AgentCLI:
    """One CLI: ``configure(home, base)`` writes its config files under ``home`` and
    returns its environment; ``turns`` are the arguments of each turn's command;
    ``answer(stdout)`` is the final answer text in what the CLI printed; ``complaints``
    are messages it prints when the server leaves it without something it needs (none may
    appear)."""

    name: str
    configure: Callable[[Path, str], dict[str, str]]
    turns: tuple[list[str], ...]
    answer: Callable[[str], str]
    complaints: tuple[str, ...] = ()


def offline_env(home: Path, proxy: str) -> dict[str, str]:
    """The base environment of a CLI: a system PATH, ``home`` as HOME and its XDG dirs,
    every proxy variable on ``proxy`` (loopback excepted), no colour, no terminal."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "USER": "user", "LANG": "C.UTF-8",
           "TERM": "dumb", "NO_COLOR": "1", "CI": "1",
           "XDG_CONFIG_HOME": str(home / ".config"), "XDG_CACHE_HOME": str(home / ".cache"),
           "XDG_DATA_HOME": str(home / ".local" / "share"), "XDG_STATE_HOME": str(home / ".local" / "state"),
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[var] = env[var.lower()] = proxy
    return env


# ---------------------------------------------------------------------- Claude Code
def _claude_env(home: Path, base: str) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": KEY, "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT)}


def _claude_answer(stdout: str) -> str:
    return json.loads(stdout)["result"]


CLAUDE = AgentCLI(
    "claude", _claude_env,
    (["-p", PROMPTS[0], "--output-format", "json", "--model", MODEL],
     ["-p", "--continue", PROMPTS[1], "--output-format", "json", "--model", MODEL]),
    _claude_answer)


# ---------------------------------------------------------------------- Codex CLI
def _codex_env(home: Path, base: str) -> dict[str, str]:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "gw"\n'
        "[model_providers.gw]\n"
        'name = "mlx-gateway"\n'
        f'base_url = "{base}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "GW_KEY"\n'
        f'model_catalog_url = "{base}/v1/models"\n')
    return {"CODEX_HOME": str(codex_home), "GW_KEY": KEY}


def _codex_answer(stdout: str) -> str:
    texts = []
    for line in stdout.splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        item = event.get("item") or {}
        if event.get("type") == "item.completed" and item.get("type") == "agent_message":
            texts.append(item.get("text", ""))
    return texts[-1] if texts else ""


CODEX = AgentCLI(
    "codex", _codex_env,
    (["exec", "--json", "--skip-git-repo-check", PROMPTS[0]],
     ["exec", "resume", "--last", "--json", "--skip-git-repo-check", PROMPTS[1]]),
    _codex_answer,
    # The model catalog (model_catalog_url) did not describe the served model.
    ("failed to refresh available models", "Model metadata for"))


# ---------------------------------------------------------------------- Qwen Code
def _qwen_env(home: Path, base: str) -> dict[str, str]:
    (home / ".qwen").mkdir(parents=True, exist_ok=True)
    settings = {"privacy": {"usageStatisticsEnabled": False}, "general": {"enableAutoUpdate": False},
                "telemetry": {"enabled": False},
                "model": {"generationConfig": {"samplingParams": {"max_tokens": MAX_OUTPUT}}}}
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings, indent=2))
    return {"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": KEY, "OPENAI_MODEL": MODEL}


def _qwen_answer(stdout: str) -> str:
    events = json.loads(stdout)
    return next((e.get("result", "") for e in reversed(events) if e.get("type") == "result"), "")


QWEN = AgentCLI(
    "qwen", _qwen_env,
    ([PROMPTS[0], "--auth-type", "openai", "-o", "json"],
     ["--continue", PROMPTS[1], "--auth-type", "openai", "-o", "json"]),
    _qwen_answer)


# ---------------------------------------------------------------------- opencode
def _opencode_env(home: Path, base: str) -> dict[str, str]:
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "mlx-gateway",
                "options": {"baseURL": f"{base}/v1", "apiKey": KEY},
                "models": {MODEL: {"name": MODEL, "limit": {"context": 32768, "output": MAX_OUTPUT}}}}
    (config / "opencode.json").write_text(json.dumps(
        {"provider": {"gw": provider}, "model": f"gw/{MODEL}", "autoupdate": False, "share": "disabled"}, indent=2))
    return {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1"}


def _opencode_answer(stdout: str) -> str:
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return "".join(e["part"].get("text", "") for e in events if e.get("type") == "text")


OPENCODE = AgentCLI(
    "opencode", _opencode_env,
    (["run", "--format", "json", "-m", f"gw/{MODEL}", PROMPTS[0]],
     ["run", "--continue", "--format", "json", "-m", f"gw/{MODEL}", PROMPTS[1]]),
    _opencode_answer)


# ---------------------------------------------------------------------- aider
def _aider_env(home: Path, base: str) -> dict[str, str]:
    meta = {f"openai/{MODEL}": {"max_input_tokens": 32768, "max_output_tokens": MAX_OUTPUT, "max_tokens": MAX_OUTPUT,
                                "input_cost_per_token": 0, "output_cost_per_token": 0,
                                "litellm_provider": "openai", "mode": "chat"}}
    (home / ".aider.model.metadata.json").write_text(json.dumps(meta, indent=2))
    return {"OPENAI_API_BASE": f"{base}/v1", "OPENAI_API_KEY": KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "AIDER_ANALYTICS": "false", "AIDER_CHECK_UPDATE": "false"}


_AIDER_FLAGS = ["--model", f"openai/{MODEL}", "--yes-always", "--no-check-update", "--no-show-release-notes",
                "--analytics-disable", "--no-show-model-warnings", "--no-pretty", "--no-fancy-input"]
AIDER = AgentCLI(
    "aider", _aider_env,
    (["--message", PROMPTS[0], *_AIDER_FLAGS],
     ["--message", PROMPTS[1], "--restore-chat-history", *_AIDER_FLAGS]),
    lambda stdout: stdout)

CLIS = {c.name: c for c in (CLAUDE, CODEX, QWEN, OPENCODE, AIDER)}
