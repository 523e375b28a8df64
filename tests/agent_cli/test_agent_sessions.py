"""Each coding-agent CLI, pinned (``install.py``), runs a two-turn headless session against
a real gateway, through a recording proxy, with its own tools in the prompt:

- Claude Code: ``claude -p ...`` then ``claude -p --continue ...`` (Anthropic Messages);
- Codex CLI: ``codex exec --json ...`` then ``codex exec resume --last ...`` (Responses,
  with the model catalog from ``/v1/models``);
- Qwen Code: ``qwen ...`` then ``qwen --continue ...`` (chat completions);
- opencode: ``opencode run ...`` then ``opencode run --continue ...`` (chat completions,
  through ``@ai-sdk/openai-compatible``);
- aider: ``aider --message ...`` then ``aider --message ... --restore-chat-history``
  (chat completions through litellm; aider sends no tools).

Asserted from what was recorded: every request the CLI made got a 2xx (else the failing
request's path, status and error body); each turn exits 0 and prints the answer the
gateway generated in one of the turn's requests (read from the recorded
response; a CLI may send side requests after the answer, e.g. Qwen Code's memory extractor); and the session's cached prompt
tokens are at least 0.95 x the ideal (per request, the longest token prefix it shares
with an earlier request of the session, from the gateway's request log). A CLI that
prints that the server left it without something it needs (Codex: no metadata for the
model in the catalog) fails too. The per-request
reuse table is printed (``-s``) and written to ``.test-agents/reports/``.

The model is the tiny qwen3 on Qwen3's tokenizer and chat template, with terse weights
(``conftest.terse_model``): its answers are random words, but they end, so each turn
completes. aider runs on the demo model instead (the project's own BPE and template, as
``--model demo``): its prompts are small (on that tokenizer opencode's first prompt is
17,800 tokens, a minute of prefill here), and it sends no tools, so on Qwen3's template it
would take the path the tool-sending CLIs' chat requests already take there. Each CLI runs
once: a second model under the same CLI sends the same requests again.

With ``MLX_GATEWAY_RECORD_AGENT_FIXTURES=1``, each session saves its request bodies as
``fixtures/<cli>/*.json`` for ``test_request_shapes.py`` (aider's in the repository were
recorded on Qwen3's template, when aider also ran there).
"""

from __future__ import annotations

import os

import pytest

from .clis import CLIS
from .install import CACHE
from .recorder import generated_text, is_generation
from .reuse import reuse_rows, table, totals
from .session import FIXTURES, RECORD_ENV, agent_session, terse_model

REUSE = 0.95  # least share of the ideal reuse a session must get
# (cli, model): qwen3 = Qwen3's tokenizer and template; demo = the project's own.
MATRIX = [(name, "demo" if name == "aider" else "qwen3") for name in CLIS]
TOOLLESS = {"aider"}  # aider asks for edits in its own text format, not through tools


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("cli,model", MATRIX, ids=[f"{c}-{m}" for c, m in MATRIX])
def test_two_turn_session(cli, model, toolbox, tmp_path):
    agent = CLIS[cli]
    command = toolbox.command(cli)
    model_dir = terse_model("qwen3" if model == "qwen3" else None)
    with agent_session(agent, command, model_dir, tmp_path, node=toolbox.node, max_tokens=64) as s:
        turns = [s.turn(i) for i in range(len(agent.turns))]
        exchanges = [e for t in turns for e in t.exchanges]
        rows = reuse_rows(s.log.records, s.server.tokenizer)
        report = table(f"{cli} on {model} ({len(exchanges)} requests, "
                       f"{', '.join(f'turn {i + 1}: {t.seconds:.1f} s' for i, t in enumerate(turns))})", rows)
        print("\n" + report)
        if s.refusals.tried:
            print(f"{cli} tried to reach (refused): {sorted(set(s.refusals.tried))}")
        (CACHE / "reports").mkdir(parents=True, exist_ok=True)
        (CACHE / "reports" / f"{cli}-{model}.md").write_text(report + "\n")
        if os.environ.get(RECORD_ENV):
            s.save_fixtures(FIXTURES / cli)

        bad = [e for e in exchanges if not 200 <= e.status < 300]
        assert not bad, f"{cli}: {len(bad)} of {len(exchanges)} requests failed:\n" + "\n".join(
            e.describe() for e in bad)
        for i, turn in enumerate(turns, 1):
            assert turn.returncode == 0, f"{cli} turn {i}: {turn.failure()}"
            said_wrong = [c for c in agent.complaints if c in turn.stdout + turn.stderr]
            assert not said_wrong, f"{cli} turn {i} complained of {said_wrong}:\n{turn.failure()}"
            answers = [e for e in turn.exchanges if is_generation(e)]
            assert answers, f"{cli} turn {i} made no generation request: {[e.describe() for e in turn.exchanges]}"
            said = [_words(generated_text(e)) for e in answers if 200 <= e.status < 300]
            assert any(said), f"{cli} turn {i}: the gateway's answers are empty: {[e.describe() for e in answers]}"
            printed = _words(agent.answer(turn.stdout))
            assert any(text and text in printed for text in said), (
                f"{cli} turn {i}: the gateway answered {said!r}; the CLI printed:\n{turn.stdout[-2000:]}")
        if cli not in TOOLLESS:
            assert any(is_generation(e) and (e.body or {}).get("tools") for e in exchanges), \
                f"{cli} sent no tools"
        assert rows, f"{cli}: the gateway logged no generation"
        _, cached, ideal = totals(rows)
        assert cached >= REUSE * ideal, f"{cli}: {cached:,} cached prompt tokens < {REUSE} x ideal {ideal:,}\n{report}"
