"""What arrives with an HTTP request, checked before any work is spent on it: the API key, and
a JSON body read with a size cap and parsed off the event loop.

A body had no cap (a 512 MiB POST took 2 GB of the server's memory) and was parsed on the event
loop (a 200 MB one stalled a robot's websocket round trips from 25 ms to 2.4 s)."""

from __future__ import annotations

import hmac
import json
from typing import Any, Callable, Mapping, Optional

#: The largest HTTP body or websocket message taken, in bytes (the websocket's cap too).
MAX_BODY_BYTES = 64 * 2**20


class BodyProblem(Exception):
    """The body cannot be taken: ``status`` (400, 413) and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def read_body(request: Any, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body's bytes, refused (413) past ``limit`` before more of it is read."""
    declared = request.headers.get("content-length")
    too_big = (f"the request body is larger than {limit // 2**20} MiB, the most this server "
               "takes; send less (large arrays: fewer or smaller frames per request)")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyProblem(413, too_big)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyProblem(413, too_big)
        parts.append(chunk)
    return b"".join(parts)


def parse_json_object(raw: bytes) -> dict:
    """``raw`` as a JSON object (run it on a worker thread: it holds the GIL throughout)."""
    try:
        body = json.loads(raw)
    except ValueError as e:  # not JSON, not UTF-8, or an integer past Python's digit limit
        raise BodyProblem(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise BodyProblem(400, "the request body nests arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise BodyProblem(400, "the request body must be a JSON object, not "
                               f"{type(body).__name__}")
    return body


async def json_object(request: Any, call: Callable[..., Any]) -> dict:
    """Reads (capped) and parses the body; ``call(fn, *args)`` runs ``fn`` off the loop."""
    return await call(parse_json_object, await read_body(request))


def key_error(headers: Mapping[str, str], api_key: Optional[str]) -> Optional[str]:
    """None if the request carries the key (``Authorization: Bearer K``, ``Authorization:
    Api-Key K`` as openpi sends it, or ``x-api-key: K``; any of them may carry it, an empty one
    counts as absent), else what is wrong."""
    if api_key is None:
        return None
    given = [headers.get("x-api-key") or ""]
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    if scheme.lower() in ("bearer", "api-key"):
        given.append(token.strip())
    given = [g for g in given if g]
    if not given:
        return ("missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>', "
                "or openpi's 'Authorization: Api-Key <key>')")
    # Header values arrive decoded as Latin-1: their bytes are what the client sent (UTF-8
    # from curl), compared with the key's UTF-8 bytes.
    want = api_key.encode()
    if not any(hmac.compare_digest(g.encode("latin-1", "replace"), want) for g in given):
        return "wrong API key"
    return None
