"""What a request's handle raises when the request does not finish (``mstar_rt.runtime``
re-exports them). A failure crosses the C++ Conductor, and a placement worker's socket, as text:
a kind of failure that a front end must tell apart travels as a tag in that text, which
:func:`request_failure` turns back into its class."""

from __future__ import annotations

import re


class RequestFailed(RuntimeError):
    """A node (or the model's state machine) raised while serving the request."""


class RequestCancelled(RuntimeError):
    """The request was cancelled before it finished."""


class DeadlineExceeded(RequestFailed):
    """A request submitted with ``fail_late`` did not make its deadline: its next work would have
    started late (``node`` is where it had got to), or, with ``refused``, submit saw that the work
    queued ahead of it could not be done in time. ``late_s``: how far past the deadline (refused:
    the expected start's distance past it)."""

    def __init__(self, message: str, node: str, refused: bool, late_s: float) -> None:
        super().__init__(message)
        self.node, self.refused, self.late_s = node, refused, late_s


class RequestTooLarge(RequestFailed, ValueError):
    """The request asks for more than its engine can ever hold: a KV cache with fewer pages than
    its prompt plus the tokens it may generate need. No wait would let it run, so it fails alone
    at admission, before it runs, holding nothing. It is the client's error, not the model's:
    servers answer 400, and it is a ValueError too (like inputs ``validate_inputs`` refuses).
    :attr:`reason` names the numbers and what to change."""

    #: what an engine starts the failure message of such a request with
    TAG = "RequestTooLarge: "

    @property
    def reason(self) -> str:
        """The engine's words, without where the request had got to."""
        text = str(self)
        return text.partition(self.TAG)[2] or text


def request_failure(message: str) -> RequestFailed:
    """The error of a request failed with ``message``: :class:`RequestTooLarge` when an engine
    tagged it so, else :class:`RequestFailed`. The tag counts only where the engine's own words
    begin (after the Conductor's "node ... failed: "): a node's error that quotes a user's text
    or another request's failure is no client error."""
    tagged = _TAGGED.match(message) is not None
    return (RequestTooLarge if tagged else RequestFailed)(message)


# "node 'n' in walk 'w' failed: " (and a decode process's "decode of request ... failed: ")
_TAGGED = re.compile(r"(?:[^:]* failed: )*" + re.escape(RequestTooLarge.TAG))
