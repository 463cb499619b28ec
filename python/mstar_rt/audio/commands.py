"""Deterministic replies to recognized robot commands: the voice agent's default responder."""

from __future__ import annotations

import re
from typing import Optional

_IRREGULAR = {"stop": "Stopping", "put": "Putting", "set": "Setting", "go": "Going",
              "get": "Getting", "drop": "Dropping", "grab": "Grabbing", "spin": "Spinning"}


def _gerund(verb: str) -> str:
    v = verb.lower()
    if v in _IRREGULAR:
        return _IRREGULAR[v]
    if v.endswith("e") and not v.endswith("ee"):
        v = v[:-1]
    return (v + "ing").capitalize()


class CommandResponder:
    """Deterministic replies to recognized robot commands: ``"move the arm to the left"`` →
    ``"Moving the arm to the left."``. ``extra`` maps exact commands to their own replies (e.g. a
    long status report); ``unknown`` answers an empty recognition."""

    FIXED = {"hello": "Hello. How can I help?", "stop": "Stopping.",
             "what time is it": "I do not have a clock yet."}

    def __init__(self, extra: Optional[dict[str, str]] = None,
                 unknown: str = "Sorry, I did not catch that.") -> None:
        self.extra = {k.lower().strip(): v for k, v in {**self.FIXED, **(extra or {})}.items()}
        self.unknown = unknown

    def __call__(self, text: str) -> str:
        words = re.findall(r"[a-z']+", text.lower())
        if not words:
            return self.unknown
        key = " ".join(words)
        if key in self.extra:
            return self.extra[key]
        if words[0] == "please":
            words = words[1:] or ["wait"]
        if len(words) > 1 and words[1] in ("up", "down") and words[0] in ("pick", "put"):
            head, rest = f"{_gerund(words[0])} {words[1]}", words[2:]
        else:
            head, rest = _gerund(words[0]), words[1:]
        return " ".join([head, *rest]) + "."
