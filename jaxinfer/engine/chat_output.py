"""The chat protocol's output side (docs/architecture.md "Chat protocol"): reasoning and tool calls parsed out of a
completion's tokens, and the grammar that makes an output tool calls (tool_choice "required" or a named function).

Formats are chosen from the tokenizer: those whose markers are all single tokens of its vocabulary (for tool calls,
of those the one its chat template writes: ``tool_call_format``). Parsing works on token ids (a marker is its
token, never text that spells it), so it holds whether the checkpoint marks the markers special or not.

- Reasoning (DeepSeek-R1: ``<think>...</think>``): a completion reasons when its prompt leaves a ``<think>`` open
  (R1's template ends the generation prompt with it) or the completion opens one; the tokens up to ``</think>``
  are ``reasoning_content`` (all of them when it never closes: cut by max_tokens), the rest the answer.
- Tool calls (``TOOL_FORMATS``: DeepSeek-V3/R1's, DeepSeek-V3.1's, Hermes / Qwen2.5 / Qwen3's ``<tool_call>``;
  each class documents its syntax, the one its chat template writes history calls in): parsed into OpenAI's shape
  (``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``, ids generated) from the first
  marker on; the text before it is the content. Anything malformed (a call cut short, arguments that are not a
  JSON object) leaves the completion as it was, with tool_calls None.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

from jaxinfer.engine.chat_protocol import json_object
from jaxinfer.engine.outputs import CompletionOutput


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _json_object(text: str) -> dict | None:
    try:
        return json_object(text, "arguments")
    except ValueError:
        return None


def _alternatives(functions: list[dict]) -> str:
    """The Lark group of the rules fn_0 ... fn_{n-1}, one per function."""
    return "(" + " | ".join(f"fn_{i}" for i in range(len(functions))) + ")"


def _schema(function: dict) -> dict:
    """A function's argument schema (any JSON object without one), laid out as templates write arguments."""
    return {**(function.get("parameters") or {"type": "object"}), "x-guidance": JSON_LAYOUT}


def _block_calls(text: str, markers: tuple[str, ...], call: re.Pattern) -> list[dict] | None:
    """The calls of a block ``markers[0]`` ... ``markers[-1]`` (the whole ``text``), each a match of ``call`` (groups
    name and args, a JSON object), whitespace between them; None if anything else is there."""
    if not text.startswith(markers[0]) or not text.endswith(markers[-1]):
        return None
    body = text[len(markers[0]):-len(markers[-1])]
    calls, pos = [], _SPACE.match(body).end()
    while pos < len(body):
        m = call.match(body, pos)
        if m is None or _json_object(m["args"]) is None:
            return None
        calls.append(_call(m["name"], m["args"].strip()))
        pos = _SPACE.match(body, m.end()).end()  # a separator, or what templates indent with (vLLM's V3 example)
    return calls or None


@dataclasses.dataclass(frozen=True)
class DeepSeekToolCalls:
    """DeepSeek-V3/R1: ``<｜tool▁calls▁begin｜>`` then calls ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json
    \nARGUMENTS\n```<｜tool▁call▁end｜>`` separated by "\n" (or any whitespace: templates indent), then
    ``<｜tool▁calls▁end｜>`` (how its chat template writes history calls; vLLM's
    examples/tool_chat_template_deepseekv3.jinja)."""

    name: str = "deepseek_v3"
    markers: tuple[str, ...] = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")

    def parse(self, text: str) -> list[dict] | None:
        """The calls of a reply's text from ``markers[0]`` on, or None if it is malformed."""
        _, call_begin, sep, call_end, _ = map(re.escape, self.markers)
        return _block_calls(text, self.markers, re.compile(
            call_begin + r"function" + sep + r"(?P<name>[^\n]+?)\n```json\n(?P<args>.*?)\n```" + call_end, re.DOTALL))

    def grammar(self, functions: list[dict], many: bool, mark, lit) -> list[str]:
        """Lark rules of replies that are calls of ``functions`` (one, or one or more if ``many``)."""
        begins, call_begin, sep, call_end, ends = map(mark, self.markers)
        rules = [f"start: {begins} call" + (f" ({lit(chr(10))} call)*" if many else "") + f" {ends}",
                 f"call: {call_begin} {lit('function')} {sep} {_alternatives(functions)}"]
        for i, function in enumerate(functions):
            rules += [f"fn_{i}: {lit(function['name'] + chr(10) + '```json' + chr(10))} args_{i} "
                      f"{lit(chr(10) + '```')} {call_end}", f"args_{i}: %json {json.dumps(_schema(function))}"]
        return rules


@dataclasses.dataclass(frozen=True)
class DeepSeekV31ToolCalls:
    """DeepSeek-V3.1: ``<｜tool▁calls▁begin｜>`` then calls ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS
    <｜tool▁call▁end｜>`` chained without separators, then ``<｜tool▁calls▁end｜>`` (the same tokens as V3's, in another
    layout; vLLM's examples/tool_chat_template_deepseekv31.jinja)."""

    name: str = "deepseek_v31"
    markers: tuple[str, ...] = DeepSeekToolCalls.markers

    def parse(self, text: str) -> list[dict] | None:
        _, call_begin, sep, call_end, _ = map(re.escape, self.markers)
        return _block_calls(text, self.markers, re.compile(
            call_begin + r"(?P<name>[^\n]+?)" + sep + r"(?P<args>.*?)" + call_end, re.DOTALL))

    def grammar(self, functions: list[dict], many: bool, mark, lit) -> list[str]:
        begins, call_begin, sep, call_end, ends = map(mark, self.markers)
        rules = [f"start: {begins} call" + ("+" if many else "") + f" {ends}",
                 f"call: {call_begin} {_alternatives(functions)} {call_end}"]
        for i, function in enumerate(functions):
            rules += [f"fn_{i}: {lit(function['name'])} {sep} args_{i}",
                      f"args_{i}: %json {json.dumps(_schema(function))}"]
        return rules


@dataclasses.dataclass(frozen=True)
class HermesToolCalls:
    """Hermes 2 Pro, Qwen2.5 and Qwen3: calls ``<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>``
    separated by "\n" (how their chat templates write history calls)."""

    name: str = "hermes"
    markers: tuple[str, ...] = ("<tool_call>", "</tool_call>")

    def parse(self, text: str) -> list[dict] | None:
        open_, close = self.markers
        call = re.compile(re.escape(open_) + r"\s*(?P<json>.*?)\s*" + re.escape(close), re.DOTALL)
        calls, pos = [], 0
        while pos < len(text):
            m = call.match(text, pos)
            value = None if m is None else _json_object(m["json"])
            if value is None or not isinstance(value.get("name"), str) or not isinstance(value.get("arguments"),
                                                                                        dict):
                return None
            calls.append(_call(value["name"], json.dumps(value["arguments"], ensure_ascii=False)))
            pos = _SPACE.match(text, m.end()).end()
        return calls or None

    def grammar(self, functions: list[dict], many: bool, mark, lit) -> list[str]:
        open_, close = map(mark, self.markers)
        rules = ["start: call" + (f" ({lit(chr(10))} call)*" if many else ""),
                 f"call: {open_} {lit(chr(10))} {_alternatives(functions)} {lit(chr(10))} {close}"]
        for i, function in enumerate(functions):
            schema = {"type": "object", "properties": {"name": {"const": function["name"]},
                                                       "arguments": _schema(function)},
                      "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_LAYOUT}
            rules.append(f"fn_{i}: %json {json.dumps(schema)}")
        return rules


ToolCallFormat = DeepSeekToolCalls | DeepSeekV31ToolCalls | HermesToolCalls


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str

    @property
    def markers(self) -> tuple[str, ...]:
        return self.start, self.end


TOOL_FORMATS = (DeepSeekToolCalls(), DeepSeekV31ToolCalls(), HermesToolCalls())
REASONING_FORMATS = (ReasoningFormat("deepseek_r1", "<think>", "</think>"),)
_SPACE = re.compile(r"\s*")
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _find(formats, tokenizer):
    for fmt in formats:
        if all(tokenizer.token_to_id(m) is not None for m in fmt.markers):
            return fmt
    return None


_PROBE = {"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": {"probe": 1}}}


def tool_call_format(tokenizer) -> ToolCallFormat | None:
    """The tokenizer's tool-call format, or None: of the formats whose markers are all tokens of its vocabulary,
    the one that parses a call back out of the chat template's own rendering of it (the template decides: V3 and
    V3.1 share their tokens); the first of them if the template renders no call."""
    candidates = [f for f in TOOL_FORMATS if all(tokenizer.token_to_id(m) is not None for m in f.markers)]
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": None, "tool_calls": [_PROBE]}]
    try:
        text = tokenizer.render_chat(probe, add_generation_prompt=False) if len(candidates) > 1 else ""
    except ValueError:  # no template, or one that renders no calls
        text = ""
    for fmt in candidates:
        start, end = text.find(fmt.markers[0]), text.rfind(fmt.markers[-1])
        calls = fmt.parse(text[start:end + len(fmt.markers[-1])]) if 0 <= start <= end else None
        if calls and calls[0]["function"]["name"] == "probe" and json.loads(calls[0]["function"]["arguments"]) == {
                "probe": 1}:
            return fmt
    return candidates[0] if candidates else None


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
        begin = tokenizer.token_to_id(tool_fmt.markers[0])
        if begin in answer:
            k = answer.index(begin)
            calls = tool_fmt.parse(tokenizer.decode(answer[k:], skip_special_tokens=False))
            if calls is not None:
                answer = answer[:k]
    return dataclasses.replace(c, text=tokenizer.decode(answer), tool_calls=calls,
                               reasoning_content=None if reasoning is None else tokenizer.decode(reasoning))


def tool_call_grammar(fmt: ToolCallFormat, tools: list[dict], name: str | None, tokenizer) -> str:
    """A Lark grammar (llguidance's syntax) for replies that are tool calls in ``fmt``: one call of the function
    ``name``, or (name None: tool_choice "required") one or more calls of any of ``tools``; each call's arguments
    follow its function's JSON Schema (any JSON object without one), laid out as chat templates write history
    calls (``tojson``: json.dumps' ", " and ": " separators, no other whitespace; llguidance's ``x-guidance``
    options), which also keeps an untuned model from padding them with whitespace. Markers are written as token ids
    (``<[id]>``), so only the marker tokens match them, never text spelling them."""
    mark = lambda s: f"<[{tokenizer.token_to_id(s)}]>"  # noqa: E731
    lit = lambda s: json.dumps(s)  # noqa: E731  (a Lark string: JSON's escapes)
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    return "\n".join(fmt.grammar(functions, name is None, mark, lit)) + "\n"
