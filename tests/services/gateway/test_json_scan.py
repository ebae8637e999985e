"""The decoder of large bodies reads what json.loads reads, and stops at the first list or
object over its cap, naming where, without reading the rest of the body."""

from __future__ import annotations

import json
import math

import pytest

from services.gateway.json_scan import TooManyItems, decode

SAME = ['{"a": [1, 2, 3], "b": {"c": [{"d": [1, 2.5, -3e2, true, false, null]}]}}', "[]", "{}", '"x"', "3",
        '{"k\\"ey": ["\\u00e9", "\\ud83d\\ude00"]}', '  [ 1 ,\n 2 ]  ']


@pytest.mark.parametrize("text", SAME)
def test_it_reads_what_json_loads_reads(text):
    assert decode(text, 6) == json.loads(text)


def test_it_keeps_json_loads_grammar_for_what_fastapi_accepts():
    value = decode('{"x": NaN, "y": "\\ud800"}', 4)
    assert math.isnan(value["x"]) and value["y"] == "\ud800"


@pytest.mark.parametrize("text", ['{"a": [1, 2', '{"a" 1}', "[1,]", "", "[1] x", '{"a": 1,}'])
def test_bad_json_fails_as_json_loads_fails(text):
    with pytest.raises(json.JSONDecodeError) as ours:
        decode(text, 6)
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(text)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("text, path", [
    ('{"messages": [1, 2, 3, 4]}', ("messages",)),
    ('{"messages": [{"content": [1, 2, 3, 4]}]}', ("messages", 0, "content")),
    ('{"a": {"b": 1, "c": 2, "d": 3, "e": 4}}', ("a",)),
    ('[[1], [1, 2, 3, 4]]', (1,)),
    ('[1, 2, 3, 4]', ()),
    ('{"' + "k" * 100 + '": [1, 2, 3, 4]}', ()),  # a key too long to name is left out
])
def test_a_list_or_object_over_the_cap_is_named(text, path):
    with pytest.raises(TooManyItems) as e:
        decode(text, 3)
    assert e.value.path == path and e.value.limit == 3


def test_it_stops_where_the_cap_is_passed_without_reading_on():
    # What follows the fourth item is not JSON: a scanner that read on would say so.
    with pytest.raises(TooManyItems):
        decode('{"messages": [1, 2, 3, 4, ' + "!" * 1000, 3)
