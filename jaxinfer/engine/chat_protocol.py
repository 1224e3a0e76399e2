"""The chat protocol's input side (docs/architecture.md "Chat protocol"): conversations, tools and tool_choice in
OpenAI's shapes, checked and turned into what a checkpoint's chat template reads.

- Messages: ``role`` one of ROLES; ``content`` a string, a list of ``{"type": "text", "text": ...}`` parts (joined
  with "\\n" into one string, as vLLM does for templates that read content as a string: DeepSeek's concatenate it)
  or None or left out (an assistant message with ``tool_calls`` only, as OpenAI's API allows). Assistant
  ``tool_calls``: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``, arguments a JSON object as
  text or as a dict; templates get dicts (transformers' convention for tool-call arguments; vLLM parses OpenAI's
  JSON text the same way before rendering). A ``tool`` message names the call it answers (``tool_call_id``), which
  must be one of the calls of the assistant message before it (only tool messages between). Other keys pass through.
- Tools: OpenAI function definitions, ``{"type": "function", "function": {"name", "description"?, "parameters"?:
  JSON Schema, "strict"?}}``, names unique and as OpenAI allows (a-z, A-Z, 0-9, _ and -, at most 64); the
  schemas are checked with jsonschema's meta-schema. They reach the template as ``tools``, as given.
- tool_choice: "auto", "none" (no tools rendered, no parsing), "required" or ``{"type": "function", "function":
  {"name": ...}}`` (the output is constrained to calls: engine/chat_output.py).

Every error is a ValueError naming the message index or the field.
"""

from __future__ import annotations

import copy
import json
import re

ROLES = ("system", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


def _text(content, where: str) -> str:
    """A content string, or text parts joined with "\\n"."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string, a list of text parts or None, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}[{j}] must be {{'type': 'text', 'text': str}} (only text parts are "
                             f"supported), got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def json_object(value, where: str) -> dict:
    """``value`` as a dict: a dict, or JSON text of an object; ValueError naming ``where`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} must be a JSON object (text or dict): {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object (text or dict), got {type(value).__name__}")
    return value


def _tool_calls(calls, i: int) -> list[dict]:
    where = f"messages[{i}]['tool_calls']"
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where} must be a non-empty list of calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ValueError(f"{at} must be a dict, got {type(call).__name__}")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise ValueError(f"{at}['id'] must be a non-empty string (tool messages answer it by tool_call_id)")
        if call.get("type") != "function":
            raise ValueError(f"{at}['type'] must be 'function', got {call.get('type')!r}")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{at}['function'] must be a dict with a non-empty 'name'")
        if "arguments" not in function:
            raise ValueError(f"{at}['function']['arguments'] is missing")
        out.append({**call, "function": {**function,
                                         "arguments": json_object(function["arguments"],
                                                                 f"{at}['function']['arguments']")}})
    return out


def normalize_messages(messages) -> list[dict]:
    """The template's messages for one conversation in OpenAI's shapes (see the module doc); the input is not
    modified. Raises ValueError naming the message index and field at fault."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    out, open_calls = [], None  # ids of the calls of the last assistant message with tool_calls, until answered
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {ROLES}, got {role!r}")
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls (role {role!r})")
        if "content" not in m:
            if calls is None:
                raise ValueError(f"messages[{i}]['content'] is missing (it may be left out or None only beside "
                                 "tool_calls)")
            m["content"] = None  # OpenAI's API: an assistant message with tool_calls may leave content out
        if m["content"] is None:
            if calls is None:
                raise ValueError(f"messages[{i}]['content'] must be a string or text parts (None only for an "
                                 "assistant message with tool_calls)")
        else:
            m["content"] = _text(m["content"], f"messages[{i}]['content']")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not open_calls:
                raise ValueError(f"messages[{i}]: a tool message must follow an assistant message with tool_calls "
                                 "(and only tool messages between)")
            if call_id not in open_calls:
                raise ValueError(f"messages[{i}]['tool_call_id'] {call_id!r} names none of the calls before it "
                                 f"{sorted(open_calls)}")
        elif calls is not None:
            m["tool_calls"] = _tool_calls(calls, i)
            open_calls = {c["id"] for c in m["tool_calls"]}
        else:
            open_calls = None
        out.append(m)
    return out


def validate_tools(tools) -> list[dict] | None:
    """``tools`` (None or OpenAI function definitions) checked; returns a copy (None for None or []). Raises
    ValueError naming ``tools[i]`` and the field."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of function definitions, got {type(tools).__name__}")
    from jsonschema import SchemaError, validators

    names = set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                           dict):
            raise ValueError(f"{at} must be {{'type': 'function', 'function': {{'name': ..., ...}}}}, got "
                             f"{tool!r:.80}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{at}['function']['name'] must be 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
        if name in names:
            raise ValueError(f"{at}['function']['name'] {name!r} is defined twice")
        names.add(name)
        if "description" in function and not isinstance(function["description"], str):
            raise ValueError(f"{at}['function']['description'] must be a string")
        if "parameters" in function:
            schema = function["parameters"]
            if not isinstance(schema, dict):
                raise ValueError(f"{at}['function']['parameters'] must be a JSON Schema object, got "
                                 f"{type(schema).__name__}")
            try:
                validators.validator_for(schema).check_schema(schema)
            except SchemaError as e:
                raise ValueError(f"{at}['function']['parameters'] is not a valid JSON Schema: {e.message}") from None
    return copy.deepcopy(list(tools)) or None


def tool_choice_name(tool_choice, tools: list[dict] | None) -> str:
    """"auto", "none", "required", or the name of the function ``tool_choice`` forces. Raises ValueError for other
    values, a function that is not among ``tools``, or "required" / a function without tools."""
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {TOOL_CHOICES} or {{'type': 'function', 'function': "
                             f"{{'name': ...}}}}, got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice='required' needs tools")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)):
        raise ValueError(f"tool_choice must be one of {TOOL_CHOICES} or {{'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {tool_choice!r:.80}")
    names = [t["function"]["name"] for t in tools or ()]
    if function["name"] not in names:
        raise ValueError(f"tool_choice names the function {function['name']!r}, which is not among the tools "
                         f"{names}")
    return function["name"]
