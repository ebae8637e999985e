"""Typed service settings: values that cannot work are refused at start-up, naming the setting."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.settings import DraftSettings, parse_load_caps


def test_load_caps_parse_ascending_pairs():
    assert parse_load_caps("") == ()
    assert parse_load_caps("8:4, 16:0") == ((8, 4), (16, 0))
    assert DraftSettings(load_draft_caps="4:8,8:2").load_draft_caps == "4:8,8:2"


@pytest.mark.parametrize("value, says", [("8-4", "SESSIONS:CAP"), ("8:4,4:2", "ascend"), ("4:2,8:4", "grow"),
                                         ("0:1", "start at 1"), ("8:x", "SESSIONS:CAP")])
def test_bad_load_caps_name_the_setting(value, says):
    with pytest.raises(ValidationError) as e:
        DraftSettings(load_draft_caps=value)
    err = e.value.errors()[0]
    assert err["loc"] == ("load_draft_caps",) and says in err["msg"]
