"""Whether a transcript is a whole sentence of a JSGF command grammar: what adaptive endpointing
asks of a hypothesis ("open the gripper" is complete, "open the" is not).

The subset of JSGF that command grammars use: rules ``[public] <name> = expansion;``, with
alternatives ``a | b``, groups ``( )``, optionals ``[ ]`` and rule references ``<name>``.
Weights, tags and ``*`` / ``+`` are refused with an error naming them. The grammar compiles to
one regular expression over words separated by single spaces.
"""

from __future__ import annotations

import re

def ends_sentence(text: str) -> bool:
    """Whether an open-vocabulary transcript reads as finished (a final '.', '?' or '!')."""
    return text.rstrip().endswith((".", "?", "!"))


_TOKEN = re.compile(r"\s*(<[^>]+>|[()\[\]|]|[^\s()\[\]|<>;]+)")


class CommandGrammar:
    """``CommandGrammar(jsgf).complete(text)``: True when ``text`` (any case and spacing) is
    one whole sentence of the grammar's public rules."""

    def __init__(self, jsgf: str) -> None:
        self.rules: dict[str, str] = {}
        public: list[str] = []
        body = re.sub(r"//[^\n]*|/\*.*?\*/", " ", jsgf, flags=re.S)
        for statement in body.split(";"):
            m = re.match(r"\s*(public\s+)?<([^>]+)>\s*=(.*)", statement, re.S)
            if m is None:
                continue  # the header, "grammar x", blank
            self.rules[m.group(2)] = m.group(3)
            if m.group(1):
                public.append(m.group(2))
        if not public:
            raise ValueError("the grammar has no public rule (public <name> = ...;)")
        self._compiled: dict[str, str] = {}
        self._pattern = re.compile("(?:" + "|".join(self._rule(r, ()) for r in public) + ")")

    def complete(self, text: str) -> bool:
        words = " ".join(re.findall(r"[a-z']+", text.lower()))
        return bool(words) and self._pattern.fullmatch(words + " ") is not None

    def _rule(self, name: str, stack: tuple[str, ...]) -> str:
        if name in stack:
            raise ValueError(f"rule <{name}> refers to itself; recursion is not supported")
        if name not in self.rules:
            raise ValueError(f"rule <{name}> is used but not defined")
        if name not in self._compiled:
            tokens = [t for t in _TOKEN.findall(self.rules[name]) if t]
            pattern, rest = self._alternatives(tokens, stack + (name,))
            if rest:
                raise ValueError(f"rule <{name}>: unexpected {rest[0]!r}")
            self._compiled[name] = pattern
        return self._compiled[name]

    def _alternatives(self, tokens: list[str], stack: tuple[str, ...]) -> tuple[str, list[str]]:
        options = []
        while True:
            seq, tokens = self._sequence(tokens, stack)
            options.append(seq)
            if not tokens or tokens[0] != "|":
                return "(?:" + "|".join(options) + ")", tokens
            tokens = tokens[1:]

    def _sequence(self, tokens: list[str], stack: tuple[str, ...]) -> tuple[str, list[str]]:
        # Each item carries its own trailing space, so optional items leave single spaces.
        items: list[str] = []
        while tokens and tokens[0] not in "|)]":
            t, tokens = tokens[0], tokens[1:]
            if t in "([":
                inner, tokens = self._alternatives(tokens, stack)
                close = ")" if t == "(" else "]"
                if not tokens or tokens[0] != close:
                    raise ValueError(f"unbalanced {t!r} in the grammar")
                tokens = tokens[1:]
                items.append(inner if t == "(" else f"(?:{inner})?")
            elif t.startswith("<"):
                items.append(self._rule(t[1:-1], stack))
            elif re.fullmatch(r"[A-Za-z']+", t):
                items.append(re.escape(t.lower()) + " ")
            else:
                raise ValueError(f"unsupported JSGF syntax {t!r} (weights, tags, * and + are not)")
        return "".join(items), tokens

    def __repr__(self) -> str:
        return f"CommandGrammar({len(self.rules)} rules)"
