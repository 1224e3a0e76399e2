"""The chat protocol's output side (docs/architecture.md "Chat protocol"): reasoning and tool calls parsed out of a
completion's tokens, and the grammar that makes an output tool calls (tool_choice "required" or a named function).

Formats are chosen from the tokenizer: the first of ``TOOL_FORMATS`` / ``REASONING_FORMATS`` whose markers are all
single tokens of its vocabulary. Parsing works on token ids (a marker is its token, never text that spells it), so
it holds whether the checkpoint marks the markers special or not.

- Reasoning (DeepSeek-R1: ``<think>...</think>``): a completion reasons when its prompt leaves a ``<think>`` open
  (R1's template ends the generation prompt with it) or the completion opens one; the tokens up to ``</think>``
  are ``reasoning_content`` (all of them when it never closes: cut by max_tokens), the rest the answer.
- Tool calls (DeepSeek-V3/R1; the chat template's own format, as vLLM's examples/tool_chat_template_deepseekv3.jinja
  writes history calls): ``<｜tool▁calls▁begin｜>`` then calls ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json
  \\nARGUMENTS\\n```<｜tool▁call▁end｜>`` separated by "\\n" (or any whitespace: templates indent), then
  ``<｜tool▁calls▁end｜>``. Parsed into OpenAI's shape (``{"id", "type": "function", "function": {"name",
  "arguments": JSON text}}``, ids generated); the text before the block is the content. Anything malformed (a
  call cut short, arguments that are not a JSON object) leaves the completion as it was, with tool_calls None.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

from jaxinfer.engine.outputs import CompletionOutput


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """A model family's tool-call markers (each one token) and the text between a call's parts."""

    name: str
    calls_begin: str
    call_begin: str
    sep: str
    call_end: str
    calls_end: str
    args_open: str = "\n```json\n"   # between the function name and its arguments
    args_close: str = "\n```"        # between the arguments and call_end
    call_sep: str = "\n"             # between two calls

    @property
    def markers(self) -> tuple[str, ...]:
        return self.calls_begin, self.call_begin, self.sep, self.call_end, self.calls_end


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str

    @property
    def markers(self) -> tuple[str, ...]:
        return self.start, self.end


TOOL_FORMATS = (ToolCallFormat("deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                               "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"),)
REASONING_FORMATS = (ReasoningFormat("deepseek_r1", "<think>", "</think>"),)
_SPACE = re.compile(r"\s*")
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _find(formats, tokenizer):
    for fmt in formats:
        if all(tokenizer.token_to_id(m) is not None for m in fmt.markers):
            return fmt
    return None


def tool_call_format(tokenizer) -> ToolCallFormat | None:
    """The tokenizer's tool-call format (its markers are tokens of the vocabulary), or None."""
    return _find(TOOL_FORMATS, tokenizer)


def reasoning_format(tokenizer) -> ReasoningFormat | None:
    """The tokenizer's reasoning markers, or None."""
    return _find(REASONING_FORMATS, tokenizer)


def _split_reasoning(ids: list[int], prompt_ids, tokenizer, fmt: ReasoningFormat) -> tuple[list[int] | None,
                                                                                            list[int]]:
    """(the reasoning's tokens or None, the answer's tokens)."""
    start, end = tokenizer.token_to_id(fmt.start), tokenizer.token_to_id(fmt.end)
    last = lambda seq, t: max((i for i, x in enumerate(seq) if x == t), default=-1)  # noqa: E731
    if last(prompt_ids, start) > last(prompt_ids, end):  # the prompt opened it
        before, body = [], ids
    elif start in ids:
        k = ids.index(start)
        before, body = ids[:k], ids[k + 1:]
    else:
        return None, ids
    if end not in body:
        return body, before
    k = body.index(end)
    return body[:k], before + body[k + 1:]


def _parse_calls(text: str, fmt: ToolCallFormat) -> list[dict] | None:
    """The calls of a block's text (from calls_begin on), or None if it is malformed."""
    if not text.startswith(fmt.calls_begin):
        return None
    body = text[len(fmt.calls_begin):]
    if not body.endswith(fmt.calls_end):
        return None
    body = body[:-len(fmt.calls_end)]
    call = re.compile(re.escape(fmt.call_begin) + r"(?P<type>[^\n]*?)" + re.escape(fmt.sep) + r"(?P<name>[^\n]+?)"
                      + re.escape(fmt.args_open) + r"(?P<args>.*?)" + re.escape(fmt.args_close)
                      + re.escape(fmt.call_end), re.DOTALL)
    calls, pos = [], 0
    while pos < len(body):
        m = call.match(body, pos)
        if m is None or m["type"] != "function":
            return None
        try:
            arguments = json.loads(m["args"])
        except json.JSONDecodeError:
            return None
        if not isinstance(arguments, dict):
            return None
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": m["name"], "arguments": m["args"].strip()}})
        pos = _SPACE.match(body, m.end()).end()  # call_sep, or what templates indent with (vLLM's example's)
    return calls or None


def parse_completion(c: CompletionOutput, prompt_ids, tokenizer, tool_fmt: ToolCallFormat | None,
                     reasoning_fmt: ReasoningFormat | None) -> CompletionOutput:
    """``c`` with ``reasoning_content`` and ``tool_calls`` parsed out of its tokens (formats None: not parsed) and
    ``text`` the rest. A completion whose text a stop string cut (its tokens spell more) is returned as it is."""
    ids = list(c.token_ids)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    if tokenizer.decode(ids) != c.text:
        return c
    reasoning, answer = (_split_reasoning(ids, list(prompt_ids), tokenizer, reasoning_fmt) if reasoning_fmt
                         else (None, ids))
    calls = None
    if tool_fmt is not None:
        begin = tokenizer.token_to_id(tool_fmt.calls_begin)
        if begin in answer:
            k = answer.index(begin)
            calls = _parse_calls(tokenizer.decode(answer[k:], skip_special_tokens=False), tool_fmt)
            if calls is not None:
                answer = answer[:k]
    return dataclasses.replace(c, text=tokenizer.decode(answer), tool_calls=calls,
                               reasoning_content=None if reasoning is None else tokenizer.decode(reasoning))


def tool_call_grammar(fmt: ToolCallFormat, tools: list[dict], name: str | None, tokenizer) -> str:
    """A Lark grammar (llguidance's syntax) for outputs that are tool calls in ``fmt``: one call of the function
    ``name``, or (name None: tool_choice "required") one or more calls of any of ``tools``; each call's arguments
    follow its function's JSON Schema (any JSON object without one), laid out as the chat template writes history
    calls (``tojson``: json.dumps' ", " and ": " separators, no other whitespace; llguidance's ``x-guidance``
    options), which also keeps an untuned model from padding them with whitespace. Markers are written as token ids
    (``<[id]>``), so only the marker tokens match them, never text spelling them."""
    mark = lambda s: f"<[{tokenizer.token_to_id(s)}]>"  # noqa: E731
    lit = lambda s: json.dumps(s)  # noqa: E731  (a Lark string: JSON's escapes)
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    rules = [f"start: {mark(fmt.calls_begin)} call" + ("" if name else f" ({lit(fmt.call_sep)} call)*")
             + f" {mark(fmt.calls_end)}",
             f"call: {mark(fmt.call_begin)} {lit('function')} {mark(fmt.sep)} ("
             + " | ".join(f"fn_{i}" for i in range(len(chosen))) + ")"]
    for i, function in enumerate(chosen):
        schema = {**(function.get("parameters") or {"type": "object"}), "x-guidance": JSON_LAYOUT}
        rules.append(f"fn_{i}: {lit(function['name'] + fmt.args_open)} args_{i} {lit(fmt.args_close)} "
                     f"{mark(fmt.call_end)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return "\n".join(rules) + "\n"
