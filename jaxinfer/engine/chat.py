"""Chat requests (``LLM.chat``, ``jaxinfer generate --chat``; docs/architecture.md "Chat protocol"): a conversation
in OpenAI's shapes with its tools, tool_choice and response_format becomes the prompt's token ids, the constraint
on its replies and the formats its replies are parsed with (engine/chat_protocol.py checks the input,
engine/chat_output.py parses the output)."""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.chat_output import (ReasoningFormat, ToolCallFormat, parse_completion, reasoning_format,
                                         tool_call_format, tool_call_grammar)
from jaxinfer.engine.chat_protocol import tool_choice_name, validate_tools
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.structured_output import StructuredOutputsParams, from_response_format

TWO_CONSTRAINTS = ("pass one constraint: response_format, a forcing tool_choice ('required' or a function) or "
                   "SamplingParams(structured_outputs=...), not both")


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """prompt_token_ids: the rendered conversation; constraint: what its replies must follow (response_format's,
    or tool calls when tool_choice forces them), None for none; tool_format / reasoning_format: how replies are
    parsed (None: not parsed)."""

    prompt_token_ids: list[int]
    constraint: StructuredOutputsParams | None
    tool_format: ToolCallFormat | None
    reasoning_format: ReasoningFormat | None

    def params(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` (None: the defaults) with this request's constraint. Raises ValueError if both constrain."""
        params = SamplingParams() if params is None else params
        if self.constraint is None:
            return params
        if params.structured_outputs is not None:
            raise ValueError(TWO_CONSTRAINTS)
        return dataclasses.replace(params, structured_outputs=self.constraint)

    def parse(self, out: RequestOutput, tokenizer) -> RequestOutput:
        """``out`` with its completions' reasoning and tool calls parsed out (in place; returned)."""
        if self.tool_format is not None or self.reasoning_format is not None:
            out.outputs = [parse_completion(c, out.prompt_token_ids, tokenizer, self.tool_format,
                                            self.reasoning_format) for c in out.outputs]
        return out


def chat_requests(tokenizer, conversations, tools=None, tool_choice="auto", chat_template_kwargs=None,
                  response_format=None) -> list[ChatRequest]:
    """One ChatRequest per conversation, all with the same tools, tool_choice, template kwargs and response_format
    (LLM.chat's arguments). Raises ValueError naming the message or field at fault."""
    if tokenizer is None:
        raise ValueError("chat needs tokenizer.json and a chat template beside the checkpoint")
    tools = validate_tools(tools)
    choice = tool_choice_name(tool_choice, tools)
    rendered = None if choice == "none" else tools
    tool_fmt = tool_call_format(tokenizer) if rendered else None
    constraint = from_response_format(response_format)
    if choice not in ("auto", "none"):
        if tool_fmt is None:
            raise ValueError(f"tool_choice {tool_choice!r}: this tokenizer has no known tool-call format (none of "
                             "engine/chat_output.py TOOL_FORMATS has all its markers among its tokens)")
        if constraint is not None:
            raise ValueError(TWO_CONSTRAINTS)
        constraint = StructuredOutputsParams(grammar=tool_call_grammar(
            tool_fmt, tools, None if choice == "required" else choice, tokenizer))
    reasoning_fmt = reasoning_format(tokenizer)
    return [ChatRequest(tokenizer.apply_chat_template(c, True, rendered, chat_template_kwargs), constraint,
                        tool_fmt, reasoning_fmt) for c in conversations]
