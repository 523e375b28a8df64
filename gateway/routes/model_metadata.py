"""What clients learn of a served model from ``GET /v1/models``: its context window,
output limit and capabilities, in the fields peers use (vLLM's ``max_model_len``,
OpenRouter's ``context_length``, ollama's ``capabilities``), and, for Codex CLI, its
model catalog.

Codex CLI asks a provider with a ``model_catalog_url`` for
``GET <url>?client_version=X`` and reads ``{"models": [ModelInfo, ...]}`` (openai/codex,
``codex-rs/protocol/src/openai_models.rs``); without an entry for the model it warns
"Model metadata for `NAME` not found" and runs on fallback metadata. :func:`codex_entry`
describes a served model in that shape: its context window, reasoning levels when its
template thinks, image input when it reads images, parallel tool calls (no
``apply_patch_tool_type``: Codex 0.169 knows only ``freeform`` there, a grammar-held tool
that small models write less reliably than a function's JSON). Codex 0.169 requires an entry to carry the model's
instructions (``model_messages.instructions_template``, which replaces Codex's own
prompt): :data:`CODEX_INSTRUCTIONS`, short, since every token of it is prefilled by a
local model (a client that wants Codex's own prompt leaves ``model_catalog_url`` out).
The fields an entry needs were found by removing them one at a time against Codex 0.169.
"""

from __future__ import annotations

from typing import Optional

from gateway.models.slot import Slot

# Codex's reasoning levels, offered for models whose template thinks; each only turns
# thinking on (the template has no budget levels).
REASONING_LEVELS = ("low", "medium", "high")

CODEX_INSTRUCTIONS = (
    "You are a coding agent in the Codex CLI, working in the user's workspace with the tools you are given.\n"
    "- Read the relevant code before changing it, and make the smallest change that does what was asked.\n"
    "- Use the shell to look around and to run the project's checks; keep commands and their output short.\n"
    "- Edit files with the patch tool when there is one.\n"
    "- Ask only when the request is ambiguous and a wrong guess would be costly.\n"
    "- End with a brief account of what you changed, what you ran, and anything left undone."
)


def capabilities(slot: Slot, kind: Optional[str]) -> list[str]:
    """What the model does: ``completion`` and ``chat`` (with ``tools``) for generating
    models, ``reasoning`` when its chat template thinks, ``vision`` when it reads images,
    ``embedding`` for embedding models. A model not loaded yet is described from its
    models-file ``kind`` alone (its template is read at load)."""
    if kind == "embedding":
        return ["embedding"]
    out = ["completion", "chat", "tools"]
    handle = slot.handle
    if handle is not None and getattr(handle.tokenizer, "has_thinking", False):
        out.append("reasoning")
    if kind == "vision":
        out.append("vision")
    return out


def context_window(slot: Slot, config: dict) -> Optional[int]:
    """The longest prompt plus answer (tokens): the loaded model's context, else its
    ``config.json``'s ``max_position_embeddings``; capped by ``max_prompt_tokens``."""
    n = slot.handle.context_length if slot.handle is not None else config.get("max_position_embeddings")
    cap = slot.spec.max_prompt_tokens
    if isinstance(n, int) and cap is not None:
        return min(n, cap)
    return n if isinstance(n, int) else cap


def codex_entry(name: str, window: Optional[int], caps: list[str]) -> dict:
    """A Codex ``ModelInfo`` for the model ``name`` (see the module docstring)."""
    thinks = "reasoning" in caps
    levels = [{"effort": e, "description": f"{e} reasoning effort"} for e in REASONING_LEVELS] if thinks else []
    entry = {
        "slug": name, "display_name": name, "description": f"{name}, served by mlx-gateway",
        "supported_reasoning_levels": levels, "shell_type": "shell_command", "visibility": "list",
        "supported_in_api": True, "priority": 0, "upgrade": None,
        "supports_reasoning_summaries": False, "support_verbosity": False, "default_verbosity": None,
        "truncation_policy": {"mode": "tokens", "limit": 10000},
        "supports_parallel_tool_calls": True, "experimental_supported_tools": [],
        "input_modalities": ["text", "image"] if "vision" in caps else ["text"],
        "model_messages": {"instructions_template": CODEX_INSTRUCTIONS},
    }
    if thinks:
        entry["default_reasoning_level"] = "medium"
    if window is not None:
        entry["context_window"] = window
    return entry
