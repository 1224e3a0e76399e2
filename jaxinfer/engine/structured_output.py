"""Structured output: constraints on a request's output (vLLM's ``StructuredOutputsParams``), enforced through
llguidance token masks.

A constrained sequence has an ``llguidance.LLMatcher`` (one per sample, in ``Grammars``), which the engine advances
with every token the sequence keeps. Before a step samples a constrained row, the matcher fills the row's allowed
tokens as llguidance's bitmask, int32 [ceil(V / 32)] words, token t allowed when bit t % 32 of word t // 32 is set
(``llguidance.numpy.apply_token_bitmask_inplace_kernel``'s order); the words travel in the step's one transfer
(``SamplingTensors.allowed``) and the sampler unpacks them on device (engine/sampler.py ``unpack_allowed``) and
masks the logits before penalties, temperature and top-k / top-p (vLLM applies its bitmask before the sampler too,
so logprobs are those of the masked distribution). Once the grammar is complete only EOS is allowed and the engine
finishes the output with "stop" (even with ``ignore_eos``).

llguidance (no torch; OpenAI's structured outputs run on it) compiles JSON Schema, regexes and Lark grammars
against the checkpoint's ``tokenizer.json``. It is imported only when a request is constrained.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, from its first output token (vLLM's ``StructuredOutputsParams``).

    Exactly one of: json (a JSON Schema, dict or str; stored as compact JSON text, keys in their order, so the
    params stay hashable),
    regex (the whole output matches it), choice (a non-empty list of strings: the output is one of them), grammar
    (a Lark grammar in llguidance's syntax), json_object (any JSON object). disable_any_whitespace: JSON without
    free whitespace (vLLM's option). Construction checks these and that a str schema parses as JSON; what
    llguidance cannot compile (an unsupported keyword, a bad regex, a Lark error) makes that request finish with
    "error" and llguidance's message instead.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StructuredOutputsParams {name}={getattr(self, name)!r} must be a bool")
        given = [k for k in KINDS if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            set_("json", _canonical_schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams {name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            items = self.choice
            if isinstance(items, str) or not isinstance(items, (list, tuple)):
                raise ValueError(f"StructuredOutputsParams choice must be a list of str, got {items!r}")
            if not items:
                raise ValueError("StructuredOutputsParams choice is an empty list: nothing could be generated")
            if not all(isinstance(c, str) and c for c in items):
                raise ValueError(f"StructuredOutputsParams choice must hold non-empty str, got {items!r}")
            set_("choice", tuple(items))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in KINDS if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None))

    @classmethod
    def parse(cls, value) -> StructuredOutputsParams | None:
        """None, a StructuredOutputsParams, or its fields as a dict (a JSONL line's "structured_outputs")."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, got "
                             f"{type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"structured_outputs has unknown keys {unknown}; it takes {', '.join(KINDS)} and "
                             f"disable_any_whitespace")
        return cls(**value)


def from_response_format(response_format) -> StructuredOutputsParams | None:
    """OpenAI's chat ``response_format``: {"type": "json_schema", "json_schema": {"schema": {...}, ...}},
    {"type": "json_object"} or {"type": "text"} (no constraint) -> StructuredOutputsParams or None."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError('response_format {"type": "json_schema"} needs "json_schema": {"schema": {...}}')
        return StructuredOutputsParams(json=spec["schema"])
    raise ValueError(f'response_format must be {{"type": "json_schema", "json_schema": {{"schema": ...}}}}, '
                     f'{{"type": "json_object"}} or {{"type": "text"}}, got {response_format!r}')


def _canonical_schema(schema) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"StructuredOutputsParams json is not JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"StructuredOutputsParams json must be a JSON Schema (an object or a bool), got "
                         f"{type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))  # keys keep their order: it is the output's property order


@functools.lru_cache(maxsize=256)  # a pure function of hashable params: requests repeat constraints
def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a constraint; compiled against a tokenizer by ``LLMatcher``."""
    import llguidance

    compile_ = llguidance.LLMatcher
    whitespace = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.json is not None:
        return compile_.grammar_from_json_schema(params.json, defaults=whitespace)
    if params.json_object:
        return compile_.grammar_from_json_schema({"type": "object"}, defaults=whitespace)
    if params.regex is not None:
        return compile_.grammar_from_regex(params.regex)
    if params.choice is not None:  # llguidance's own "choice" format (llguidance.grammar_from)
        return compile_.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    return compile_.grammar_from_lark(params.grammar)


class Grammars:
    """The llguidance side of one engine: the tokenizer (built once, from the checkpoint's tokenizer.json through
    ``tokenizers``), a thread pool for masks, and one matcher per constrained sequence (by sequence id; the
    engine's bookkeeping, like vLLM's StructuredOutputManager).

    tokenizer_json: the ``tokenizers`` JSON text; vocab_size: the model's V (ids past the tokenizer's are never
    allowed); eos_token_id: the token a complete grammar allows."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.words = -(-vocab_size // 32)  # W: mask words per row
        self._matchers: dict = {}  # seq id -> llguidance.LLMatcher
        self._stuck: set[int] = set()  # seq ids whose grammar allowed no token at their last mask

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:  # constrained sequences: an engine without any skips the per-step work
        return len(self._matchers)

    @functools.cached_property
    def _tokenizer(self):
        import llguidance

        return llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_id)

    @functools.cached_property
    def _executor(self):
        import llguidance

        return llguidance.LLExecutor()

    def add(self, seq_ids: Sequence[int], params: StructuredOutputsParams) -> str | None:
        """Matchers for a request's samples, at the start of their outputs; llguidance's error (and no matcher)
        when the constraint does not compile."""
        import llguidance

        try:
            grammar = grammar_text(params)
        except ValueError as e:  # llguidance's own check of a schema it cannot read
            return f"structured_outputs: {e}"
        matchers = [llguidance.LLMatcher(self._tokenizer, grammar, log_level=0) for _ in seq_ids]
        if matchers and matchers[0].is_error():
            return f"structured_outputs: {matchers[0].get_error()}"
        self._matchers.update(zip(seq_ids, matchers))
        return None

    def masks(self, seq_ids: Sequence[int], drafts: dict[int, Sequence[int]] | None = None
              ) -> dict[int, np.ndarray]:
        """int32 [1 + D, W] allowed-token words of each constrained sequence among ``seq_ids``: row 0 for its next
        token, row j for the token after its first j drafts (``drafts``: the D draft tokens a speculative step
        verifies; llguidance's parallel fill, with draft tokens where there are any). Rows after a draft the grammar
        rejects are left all-allowed: verification stops at that draft. A grammar that allows no token (the
        tokenizer cannot spell what it needs) gets EOS only at row 0, and ``consume`` then ends it with "error"."""
        import llguidance.numpy as llg_numpy

        ids = [i for i in seq_ids if i in self._matchers]
        if not ids:
            return {}
        drafts = {i: [int(t) for t in drafts.get(i, ())] for i in ids} if drafts else {}
        offsets = np.cumsum([0] + [1 + len(drafts.get(i, ())) for i in ids])  # [len(ids) + 1]
        words = np.full((offsets[-1], self.words), -1, np.int32)  # [rows, W]
        # llguidance's fill with drafts refuses a matcher with none (a sequence verifying no draft this step, e.g.
        # one token from max_tokens), so those take the plain fill.
        with_drafts = [k for k, i in enumerate(ids) if drafts.get(i)]
        plain = [k for k, i in enumerate(ids) if not drafts.get(i)]
        if with_drafts:
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [(self._matchers[ids[k]], int(offsets[k]), drafts[ids[k]]) for k in with_drafts],
                words)
        if plain:
            llg_numpy.fill_next_token_bitmask_par(
                self._executor, [(self._matchers[ids[k]], int(offsets[k])) for k in plain], words)
        eos = np.zeros(self.words, np.int32)  # [W]: EOS alone
        if self.eos_token_id is not None:
            eos[self.eos_token_id // 32] = np.uint32(1 << self.eos_token_id % 32).view(np.int32)
        for k, i in enumerate(ids):
            # Stuck: nothing allowed, or only EOS (llguidance's answer when the vocabulary cannot go on) before the
            # grammar is complete.
            first = words[offsets[k]]
            if not first.any() or ((first == eos).all() and not self._matchers[i].is_accepting()):
                self._stuck.add(i)
                words[offsets[k]:offsets[k + 1]] = eos
        return {i: words[offsets[k]:offsets[k + 1]] for k, i in enumerate(ids)}

    def consume(self, seq_id: int, token_ids: Sequence[int]) -> tuple[str, str | None] | None:
        """Advances a sequence's matcher by the tokens it kept -> None (go on), ("stop", None) when the grammar
        is complete (only EOS could follow; tokens after that point are not fed), or ("error", message)."""
        matcher = self._matchers[seq_id]
        if seq_id in self._stuck:
            return "error", "structured_outputs: no token of the vocabulary can continue the grammar"
        for token in token_ids:
            if matcher.is_stopped():
                break
            if not matcher.consume_token(int(token)):
                return "error", f"structured_outputs: {matcher.get_error()}"
        return ("stop", None) if matcher.is_stopped() else None

    def forced(self, seq_id: int) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: the only continuation its
        grammar and the tokenizer allow, each with probability 1 under the masks), not consumed; [] for a complete
        or stuck grammar."""
        matcher = self._matchers[seq_id]
        if seq_id in self._stuck or matcher.is_stopped() or matcher.is_error():
            return []
        return [int(t) for t in matcher.compute_ff_tokens()]

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
        self._stuck.discard(seq_id)
