"""The JSON decoder of large request bodies (services.gateway.app.BodyParser).

It reads json.loads' own grammar (NaN, lone surrogates: as FastAPI reads a body) through the
pure-Python scanner, so that the worker thread parsing a large body lets the event loop run
(the C scanner holds the GIL for the whole body). And it stops at the first list or object
holding more than max_items items, more than any field of a request may hold: a 4 MiB body of
140,000 one-character messages is refused after its first max_items messages, instead of
costing a core the whole parse (on a small machine the model's forwards share that core).
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
from typing import Any

_KEY = re.compile(r'"([^"\\]{1,64})"[ \t\n\r]*:[ \t\n\r]*$')  # the key before an object's value


class TooManyItems(ValueError):
    """A list or object of the body holds more than `limit` items; `path` names where (keys and
    indices from the body's top, as far as they are known)."""

    def __init__(self, path: tuple[str | int, ...], limit: int):
        super().__init__(f"at most {limit} items in a list or object, got more")
        self.path, self.limit = path, limit


def decode(text: str, max_items: int) -> Any:
    """The JSON value of text (json.JSONDecodeError as json.loads raises it), or TooManyItems
    as soon as one of its lists or objects passes max_items."""
    path: list[str | int | None] = []  # where the scanner is, for the error

    def counted(scan_once, key):
        n = 0

        def item(s: str, end: int):
            nonlocal n
            if n >= max_items:
                known = []
                for part in path:
                    if part is None:
                        break
                    known.append(part)
                raise TooManyItems(tuple(known), max_items)
            path.append(key(s, end, n))
            n += 1
            try:
                return scan_once(s, end)
            finally:
                path.pop()

        return item

    def object_key(s: str, end: int, _n: int) -> str | None:
        found = _KEY.search(s, max(0, end - 96), end)
        return found.group(1) if found else None

    def parse_array(s_and_end, scan_once):
        return json.decoder.JSONArray(s_and_end, counted(scan_once, lambda s, end, n: n))

    def parse_object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
        return json.decoder.JSONObject(s_and_end, strict, counted(scan_once, object_key), object_hook,
                                       object_pairs_hook, memo)

    decoder = json.JSONDecoder()
    decoder.parse_array, decoder.parse_object = parse_array, parse_object
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder.decode(text)
