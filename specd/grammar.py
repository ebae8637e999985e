"""Structured output: a grammar (any JSON object, or a JSON schema) that masks the target's
logits at every position of a window, through llguidance.

Row j of a window follows the committed tokens and the first j drafts, so its mask is the
grammar's after those drafts: the matcher consumes the drafts one by one while it masks, and
rolls back afterwards. A draft the grammar forbids ends the window there (the target could
never emit it). Verification then judges the kept drafts against the masked distribution, the
very one the target alone samples from under the grammar, so greedy output is constrained
decoding's, token for token, and sampled output follows it.

Where the grammar forces what comes next (a key name, a brace), those tokens are drafts that
cost no drafter call (Grammar.forced): specd.engine drafts them itself, and they are accepted
wherever the target's masked distribution leaves only them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specd.errors import InvalidRequest

MAX_SCHEMA_CHARS = 1 << 16
KINDS = ("json_object", "json_schema", "lark")  # lark: llguidance's Lark grammar text (tool calls, specd.tools)
FIELD = "response_format"
_SPECIAL = re.compile(r"<special:(\[[A-Z_]+\])>")


def special(token: str) -> str:
    """A Lark grammar's reference to the model's control token `token` (such as Mistral's
    [TOOL_CALLS]) by its text: the grammar of a model's tokenizer finds its id."""
    return f"<special:{token}>"


def token_id(tokenizer, token: str) -> int | None:
    """The id of the token whose text is `token` in tokenizer's vocabulary, or None."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or tokenizer.convert_ids_to_tokens(found) != token:
        return None  # unknown: the unknown token's id, or None
    return found


def _token_id(tokenizer, token: str) -> int:
    if tokenizer is None:  # checked without a model: any id compiles alike
        return 0
    found = token_id(tokenizer, token)
    if found is None:
        raise InvalidRequest(FIELD, f"the grammar names {token}, which this model's tokenizer has not")
    return found


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must be: `json_object` (any JSON object), `json_schema` (schema: the
    schema's JSON text) or `lark` (schema: a Lark grammar, as llguidance reads it)."""

    kind: str
    schema: str = ""

    def grammar(self, tokenizer=None) -> str:
        """llguidance's grammar; a Lark grammar's control tokens (special) resolved in tokenizer."""
        from llguidance import LLMatcher

        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(_SPECIAL.sub(lambda m: f"<[{_token_id(tokenizer, m.group(1))}]>",
                                                            self.schema))
        return LLMatcher.grammar_from_json_schema(self.schema if self.kind == "json_schema" else '{"type": "object"}')

    def validate(self) -> None:
        """InvalidRequest naming response_format for an unknown kind or a schema llguidance
        cannot compile; cheap enough for the gateway, which has no tokenizer."""
        if self.kind not in KINDS:
            raise InvalidRequest(FIELD, f"type must be json_object, json_schema or text, got {self.kind!r}")
        if self.kind == "json_object":
            return
        if len(self.schema) > MAX_SCHEMA_CHARS:
            raise InvalidRequest(FIELD, f"the schema is at most {MAX_SCHEMA_CHARS} characters, got {len(self.schema)}")
        if self.kind == "json_schema":
            try:
                json.loads(self.schema)
            except ValueError as e:
                raise InvalidRequest(FIELD, f"the schema is not JSON: {e}") from None
        from llguidance import LLMatcher

        try:
            error = LLMatcher.validate_grammar(self.grammar())
        except (ValueError, RuntimeError) as e:
            error = str(e)
        if error:
            raise InvalidRequest(FIELD, f"the schema cannot be used: {error.splitlines()[0][:300]}")


class _Tokens:
    """What llguidance needs of a tokenizer it cannot read itself (one whose decoder is not
    byte-level or byte-fallback, such as the tests' character tokenizer): each id's bytes."""

    def __init__(self, tokenizer, vocab_size: int):
        specials = set(tokenizer.all_special_ids)
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i in specials if i < vocab_size)
        self.tokens = [b"\xff<" + str(i).encode() + b">" if i in specials or i >= len(tokenizer)
                       else tokenizer.decode([i]).encode("utf-8") for i in range(vocab_size)]
        self.tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        return self.tokenizer.encode(text, add_special_tokens=False)


_TOKENIZERS: dict[tuple[int, int], tuple[object, object]] = {}  # (id(tokenizer), vocab) -> (tokenizer, LLTokenizer)


def _ll_tokenizer(tokenizer, vocab_size: int, eos: Sequence[int]):
    """llguidance's tokenizer for `tokenizer`, built once per tokenizer (about a second)."""
    key = (id(tokenizer), vocab_size)
    if key not in _TOKENIZERS:
        import llguidance
        import llguidance.hf

        eos_ids = sorted(eos) or None
        try:
            ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
        except (ValueError, TypeError, AttributeError):
            ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens(tokenizer, vocab_size)),
                                        n_vocab=vocab_size, eos_token=eos_ids)
        _TOKENIZERS[key] = (tokenizer, ll)  # the tokenizer is kept, so its id is not reused
    return _TOKENIZERS[key][1]


class Grammar:
    """One request's grammar state, after its committed tokens."""

    def __init__(self, spec: GrammarSpec, tokenizer, vocab_size: int, eos: Sequence[int]):
        from llguidance import LLMatcher

        if tokenizer is None:
            raise InvalidRequest(FIELD, "this model has no tokenizer to constrain its output with")
        self.vocab = vocab_size
        self.matcher = LLMatcher(_ll_tokenizer(tokenizer, vocab_size, eos), spec.grammar(tokenizer))
        if self.matcher.is_error():
            raise InvalidRequest(FIELD, f"the grammar cannot be used: {self.matcher.get_error()[:300]}")

    @classmethod
    def for_model(cls, spec: GrammarSpec, model) -> Grammar:
        """The grammar state of a LoadedModel's tokenizer, over the ids it emits."""
        return cls(spec, model.tokenizer, model.emitted_vocab, model.eos_token_ids)

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next [vocab] (bool)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.vocab].astype(bool))

    def constrain(self, logits: torch.Tensor, drafts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """logits [R, V] of a window (row j after the committed tokens and drafts[:j]) -> (the
        logits with what the grammar forbids at each row set to -inf, how many leading drafts
        it allows). Rows past that many drafts plus one are left as they are: nobody reads them."""
        out = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
        kept = 0
        for j in range(out.shape[0]):
            allowed = self.allowed()  # on the host: read there, one copy to the device per row
            out[j, :self.vocab].masked_fill_(~allowed.to(out.device), float("-inf"))
            if j >= len(drafts) or j == out.shape[0] - 1:
                break
            token = drafts[j]
            if not (0 <= token < self.vocab and bool(allowed[token])) or not self.matcher.consume_token(token):
                break
            kept += 1
        if kept:
            self.matcher.rollback(kept)
        return out, kept

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (none where it leaves a choice)."""
        return list(self.matcher.compute_ff_tokens()[:limit]) if limit > 0 else []

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens emitted (each one the grammar allowed: the target's masked choice)."""
        for t in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"the grammar refused emitted token {t}: {self.matcher.get_error()[:200]}")
