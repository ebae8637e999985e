"""Incremental detokenization: the streamed deltas always add up to the full decoding,
characters split across byte-level tokens are held back until complete, and stop strings
are cut exactly, even when they arrive split across pushes."""

from __future__ import annotations

import pytest

from specd.detok import TextStream, first_stop, held_back
from specd.runtime.tiny import char_tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    unprintable = [b for b in range(256) if b not in bs]
    bs += unprintable
    cs += [256 + n for n in range(len(unprintable))]
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A real byte-level BPE tokenizer with no merges: one token per UTF-8 byte (id = byte), so
    every non-ASCII character is split across tokens, as rare characters are in GPT-2 or Llama 3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def chars():
    return char_tokenizer()


def _encoder(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def _stream_all(tokenizer, ids, chunk: int, stop=()) -> tuple[list[str], list[int], TextStream]:
    stream = TextStream(tokenizer, stop)
    texts, kept = [], []
    for i in range(0, len(ids), chunk):
        delta = stream.push(ids[i:i + chunk])
        texts.append(delta.text)
        kept.extend(delta.token_ids)
    tail = stream.finish()
    return texts + [tail.text], kept + list(tail.token_ids), stream


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_split_utf8_characters_are_held_back_until_complete(byte_tokenizer, chunk):
    text = "héllo €uro 😀 ok"
    ids = list(text.encode())
    texts, kept, _ = _stream_all(byte_tokenizer, ids, chunk)
    assert "".join(texts) == text
    assert kept == ids
    assert not any("\ufffd" in t for t in texts)


def test_an_incomplete_character_at_the_end_is_flushed_by_finish(byte_tokenizer):
    stream = TextStream(byte_tokenizer)
    assert stream.push(list("a€".encode())[:-1]).text == "a"
    assert stream.finish().text == "\ufffd"


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_cuts_text_and_ids(chars, chunk):
    text = "Hello world\nUser: more text after"
    ids = chars(text, add_special_tokens=False)["input_ids"]
    texts, kept, stream = _stream_all(chars, ids, chunk, stop=("\nUser:",))
    assert stream.stopped
    assert "".join(texts) == "Hello world"
    # The fewest ids whose decoding contains the stop string: through its last character.
    assert kept == ids[:len("Hello world\nUser:")]


def test_a_possible_stop_prefix_is_held_then_released(chars):
    stream = TextStream(chars, stop=("STOP",))
    enc = _encoder(chars)
    assert stream.push(enc("abc ST")).text == "abc "
    assert stream.push(enc("O")).text == ""
    assert stream.push(enc("P!")).text == ""  # "STOP" completed: nothing after it
    assert stream.stopped and stream.push(enc("more")).text == ""


def test_held_prefix_that_does_not_become_a_stop_is_released(chars):
    stream = TextStream(chars, stop=("STOP",))
    enc = _encoder(chars)
    assert stream.push(enc("a ST")).text == "a "
    assert stream.push(enc("OX")).text == "STOX"
    assert stream.push(enc(" STO")).text == " "
    assert stream.finish().text == "STO"  # no more tokens: the held prefix is plain text
    assert not stream.stopped


def test_special_and_unknown_ids_add_no_text_but_are_kept(chars):
    eos = chars.convert_tokens_to_ids("<|im_end|>")
    stream = TextStream(chars)
    delta = stream.push(chars("ab", add_special_tokens=False)["input_ids"] + [eos, 120])
    assert delta.text == "ab" and len(delta.token_ids) == 4


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_kept_control_tokens_keep_their_text_and_only_theirs(chunk):
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    calls, eos = tok.convert_tokens_to_ids("[TOOL_CALLS]"), tok.convert_tokens_to_ids("<|im_end|>")
    ids = _encoder(tok)("Hi ") + [calls] + _encoder(tok)(' [{"a": 1}]') + [eos]
    stream = TextStream(tok, keep={calls: "[TOOL_CALLS]"})
    texts = [stream.push(ids[i:i + chunk]).text for i in range(0, len(ids), chunk)] + [stream.finish().text]
    assert "".join(texts) == 'Hi [TOOL_CALLS] [{"a": 1}]'
    assert "".join(_stream_all(tok, ids, chunk)[0]) == 'Hi  [{"a": 1}]'  # dropped where not kept


@pytest.mark.parametrize("text, stop, want", [
    ("hello", ("lo!",), 2),  # "lo" may become "lo!"
    ("hello", ("xyz",), 0),
    ("hello", ("o", "llo!"), 3),  # the longest candidate wins
    ("hello", ("hello",), 0),  # a complete stop string is not a *proper* prefix
    ("", ("abc",), 0),
    ("ab", ("abc", "b"), 2),
])
def test_held_back(text, stop, want):
    assert held_back(text, stop) == want


def test_first_stop_finds_the_earliest_of_several():
    assert first_stop("one two three", ("three", "two"), 0) == 4
    assert first_stop("one two three", ("two",), 5) is None
    assert first_stop("abc", (), 0) is None
