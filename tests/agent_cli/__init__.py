"""Coding-agent CLIs (Claude Code, Codex CLI, Qwen Code, opencode, aider), pinned, run
headless against a real gateway, and the request shapes they send, replayed."""
