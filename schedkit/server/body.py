"""Request bodies to JSON values, in time linear in their size.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), and a body's UTF-8 may encode
one (the bytes ``ED A0 80``, which Python's ``json`` lets through); either decodes to a
``str`` that no tokenizer, regex compiler, log or reply can encode. :func:`decode_json`
finds them without looking at the decoded value: the strict decode of the bytes finds an
encoded one, one regular-expression pass over the text an escaped one that is not half
of a high + low pair. Only a body that has one is walked, for a bounded number of
values, to name the field that holds it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from schedkit.server.protocol import APIError

MAX_WALK_VALUES = 100_000
"""Values looked at to name the field with a lone surrogate; past them the 400 names none."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""The start of a surrogate's escape (or of an escaped backslash followed by ``ud800``)."""
_SURROGATE_PAIR = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def decode_json(raw: bytes) -> Any:
    """The JSON value of a request body.

    Raises:
        APIError: 400 when it is not JSON (or not UTF-8, or nested too deeply), or when
            a string or key in it is not valid Unicode text (a lone surrogate, escaped
            or encoded): the message and ``param`` name the field where they can.
    """
    text, encoded_surrogate = _text_of(raw)
    try:
        body = json.loads(text)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if encoded_surrogate or has_lone_surrogate_escape(text):
        raise _lone_surrogate_error(body)
    return body


def _text_of(raw: bytes) -> tuple[str, bool]:
    """The body as text (UTF-8, or the UTF-16/32 JSON allows with its encoding detected as
    ``json`` does), and whether it encodes a surrogate (decoded as is, to name its field).

    Raises:
        APIError: 400 for bytes that are not text in that encoding.
    """
    encoding = json.detect_encoding(raw)
    try:
        return raw.decode(encoding), False
    except UnicodeDecodeError as e:
        try:
            return raw.decode(encoding, "surrogatepass"), True
        except UnicodeDecodeError:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None


def has_lone_surrogate_escape(text: str) -> bool:
    """Whether JSON ``text`` has a ``\\uD800``-``\\uDFFF`` escape that is not half of a
    high + low pair. Linear, in C: only when a surrogate escape may appear at all, each
    escaped backslash becomes a ``#`` (two adjacent backslashes in JSON are always one, so
    every backslash left starts an escape: ``\\\\ud800`` is text; and a ``#`` keeps
    ``\\ud800\\\\\\udc00`` two lone halves), the valid pairs are dropped, and what is
    left is searched."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return False
    escapes = text.replace("\\\\", "#")
    return _SURROGATE_ESCAPE.search(_SURROGATE_PAIR.sub("", escapes)) is not None


def _lone_surrogate_error(body: Any) -> APIError:
    try:
        path = _unencodable_path(body, MAX_WALK_VALUES)
    except _WalkTooLong:
        path = None
    if path is None:  # not found in time (or not at all: the scan found one; still a 400)
        return APIError(400, "the request body has text that is not valid Unicode (a lone UTF-16 "
                        "surrogate)")
    where = _field_path(path)
    return APIError(400, f"{where or 'a key'}: not valid Unicode text (a lone UTF-16 surrogate)",
                    param=where or None)


class _WalkTooLong(Exception):
    """The walk naming a lone surrogate's field gave up (too many values)."""


def _unencodable_path(value: Any, budget: int) -> list[str | int] | None:
    """The keys and indices to the first string in ``value`` that UTF-8 cannot encode
    (for a key, the path of its object), or None. A loop over a stack of iterators, not
    a recursive closure: it leaves no reference cycle behind (nothing for the garbage
    collector) and no depth limit.

    Raises:
        _WalkTooLong: Over ``budget`` values were looked at first.
    """
    if isinstance(value, str):
        return None if _encodes(value) else []
    if not isinstance(value, (list, dict)):
        return None
    path: list[str | int] = []  # the keys to the container on top of the stack
    stack = [_items(value)]
    while stack:
        step = next(stack[-1], None)
        if step is None:
            stack.pop()
            if path:
                path.pop()
            continue
        budget -= 1
        if budget < 0:
            raise _WalkTooLong
        k, x = step
        if isinstance(k, str) and not _encodes(k):
            return path
        if isinstance(x, str):
            if not _encodes(x):
                return [*path, k]
        elif isinstance(x, (list, dict)):
            path.append(k)
            stack.append(_items(x))
    return None


def _items(container: list[Any] | dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    return enumerate(container) if isinstance(container, list) else iter(container.items())


def _encodes(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _field_path(path: list[str | int]) -> str:
    """Keys and indices as OpenAI writes a param: ``messages[0].content``."""
    out = ""
    for x in path:
        out += f"[{x}]" if isinstance(x, int) else f".{x}" if out else x
    return out
