"""A custom tool's grammar, for its input as it appears inside a JSON string.

OpenAI's Responses API lets a ``custom`` tool constrain its free-form input with a grammar
(``format: {type: "grammar", syntax: "lark" | "regex", definition}``; Codex CLI's
``apply_patch`` sends a Lark grammar). Open models write a call as JSON, e.g. Qwen3's
``{"name": "apply_patch", "arguments": {"input": "..."}}``, so the grammar must hold of the
input *escaped*: each character c appears as esc(c), JSON string escaping as
``json.dumps(s, ensure_ascii=False)[1:-1]`` writes it (``"`` -> ``\\"``, ``\\`` -> ``\\\\``,
``\\n \\r \\t \\b \\f``, other characters below U+0020 -> ``\\u00xx``, everything else
unchanged). The escaped language is the image of the raw one under the homomorphism esc,
so it is again context-free: apply esc to every terminal. :func:`escaped_lark` and
:func:`escaped_regex` build it as Lark rules (llguidance's dialect, docs/syntax.md in
guidance-ai/llguidance) to append to a host grammar.

The modules, bottom up: :mod:`.json_escapes` (esc and its escape sequences as regexes),
:mod:`.regex_nodes` (regexes as nodes split at the characters esc changes),
:mod:`.rust_regex` and :mod:`.lark_reader` (the two input syntaxes, read into nodes),
:mod:`.escaped_languages` (a node's escaped form as lexemes and rules; how and why),
:mod:`.lark_grammar` (a whole grammar's rules, options and ``%ignore``).

Supported: string literals (``"..."i`` too), ``"a".."z"``, regexes with flags i m s x U,
classes (nested, ``&&``/``--``/``~~``, ``\\p{..}``, POSIX), ``.``, ``\\d \\w \\s`` and
negations, escapes, groups (named, flag groups), alternation, repeats (greedy or lazy: the
same language), anchors at the ends (dropped); ``->`` aliases (dropped); ``?rule``,
``!rule``; rule options ``capture``, ``lazy``, ``stop=``/``suffix=`` (such a rule stays one
lexeme, exact since it ends at its first match); ``%import common.X``; ``%ignore``, as
explicit optional lexemes between the grammar's lexemes (a ``%ignore`` line would apply
to the whole host grammar). Membership of specials in a class is decided by llguidance
itself, so it follows Rust's regex semantics (``\\s`` lacks U+001C..U+001F, unlike
Python's). Refused (:class:`GrammarConversionError`, naming the construct): special
tokens, ``%json``/``%regex``/``%lark``/``%llguidance``/``%declare``/``%override``,
``@grammar`` references, the ``&``/``~`` operators, templates, priorities, parametric
rules, ``max_tokens``/``temperature``, look-around, backreferences, word boundaries,
inner anchors, ``(?-u)``.

Limits. (1) Where llguidance's lexer would commit to extending the current raw lexeme over
a special although the next terminal could start there, the escaped grammar keeps both
readings, so for raw grammars whose terminals compete at specials it accepts a few more
strings; apply_patch's terminals do not compete. (2) llguidance also skips ``%ignore``
text after the last lexeme where another could follow; the escaped grammar never ends in
ignored text. (3) ``S{m,n}`` over a set holding specials is counted exactly by O(n^2)
rules, so n is at most 32; other bounded repeats of escapable text are expanded, up to a
size limit. (4) Very ambiguous regexes (nested repeats that fold into no simpler form)
become ambiguous rules, which can exceed llguidance's Earley item limit on long inputs.
(5) Captures hold escaped text.

Sources: llguidance's Lark dialect (docs/syntax.md) and lexer (parser/src/earley/lexer.rs:
greedy, one byte of lookahead; ``%ignore`` skipped after a lexeme), Lark's common.lark for
the ``%import common`` names, RFC 8259 section 7 and CPython's ``json`` encoder for esc.
"""

from __future__ import annotations

from gateway.conversation.escaped_grammar.errors import GrammarConversionError
from gateway.conversation.escaped_grammar.escaped_languages import EscapedLanguages
from gateway.conversation.escaped_grammar.lark_grammar import LarkConverter
from gateway.conversation.escaped_grammar.rust_regex import RustRegex

__all__ = ["GrammarConversionError", "escaped_lark", "escaped_regex"]


def escaped_lark(grammar: str, prefix: str) -> tuple[str, str]:
    """Lark rules matching exactly esc(s) for every s that ``grammar`` matches.

    Args:
        grammar: an llguidance-dialect Lark grammar for the raw text, rooted at ``start``.
        prefix: letters and digits; every name defined here starts with it (rules
            ``<prefix>_start``, terminals ``<PREFIX>_LF``; a terminal that needs several
            lexemes once escaped becomes a rule ``<prefix>_name``), so the rules can be
            appended to a host grammar, or beside another tool's under another prefix
            (prefixes compare without case).

    Returns:
        ``(rules, root)``: Lark text and the name of the rule to reference from the host,
        between the lexemes that open and close the JSON string. The host must not have a
        ``%ignore`` of its own (llguidance would skip it inside the string too).

    Raises:
        GrammarConversionError: a construct with no escaped form (named), or a bad grammar.
    """
    try:
        return LarkConverter(prefix).lark(grammar)
    except RecursionError:
        raise GrammarConversionError("nesting too deep") from None


def escaped_regex(regex: str, prefix: str) -> tuple[str, str]:
    """Lark rules whose rule ``root`` matches exactly esc(s) for each s that ``regex``
    (Rust regex syntax, matched against the whole input) matches; as :func:`escaped_lark`.
    """
    conv = EscapedLanguages(prefix)
    root = conv.fresh(f"{conv.p}_start")
    try:
        conv.out.append(f"{root}: {conv.lexeme(conv.esc(RustRegex(regex, '').parse()))}")
    except RecursionError:
        raise GrammarConversionError("nesting too deep") from None
    return conv.finish(), root
