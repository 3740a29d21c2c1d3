"""Function tools in a chat (OpenAI's `tools` and `tool_choice`): checking them, a forced choice as a grammar
over the tools' schemas, and a conversation with tool calls for the model's chat template. Chapter 05
(serving: reasoning and tool calls).

Qwen3 calls a tool by writing a Hermes block, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
(its chat template renders the `tools` and the earlier calls that way; `parsers.py` reads them back).
`tool_choice`: "none" (no call is read), "auto" (the model decides; the server reads what it wrote),
"required" (one call or more) or `{"type": "function", "function": {"name": ...}}` (exactly that call). The
last two are enforced by a grammar (`tool_grammar`: xgrammar's structural tag of the Hermes blocks, each
with the tool's parameters as its JSON schema), so even a random-weight model returns a valid call.

A chat template that has no place for tools (SmolLM2's mentions none) gets them the Hermes way in words
(`template_inputs`): the tools in the system message, each earlier call as a Hermes block in the
assistant's text, each tool's answer as a user turn in `<tool_response>` tags (Qwen3's own rendering).
"""

from __future__ import annotations

import json
import re
from typing import Any

from nanoengine.errors import InvalidTypeError, InvalidValueError
from nanoengine.structured import JSON_MAX_WHITESPACE, StructuredOutputsParams
from nanoengine.tokenizer import message_text, render_chat

TOOL_CHOICES = ("none", "auto", "required")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for a function's name (and "." as vLLM allows)
CALL_BEGIN, CALL_ARGS, CALL_END = '<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>"
CALL_SEPARATOR = "\n"  # between two calls, as Qwen3's template writes them
HERMES_SYSTEM = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                 "provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                 "</tools>\n\nFor each function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
                 "\"arguments\": <args-json-object>}}\n</tool_call>")


class ToolError(InvalidValueError):
    """A bad `tools` or `tool_choice` (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str = "tools") -> None:
        super().__init__(message)
        self.param = param


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's function tools, checked: each {"type": "function", "function": {"name", "description"?,
    "parameters"? (a JSON schema object)}}."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise InvalidTypeError(f"tools must be a list of function tools, got {type(tools).__name__}")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                            f"'parameters': ...}}}}, got {t!r:.80}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '-' or '.', got "
                            f"{name!r:.80}")
        if name in names:
            raise ToolError(f"tools[{i}]: two tools are named {name!r}; give each its own name")
        names.add(name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object, got "
                            f"{fn['parameters']!r:.80}")
    return [{"type": "function", "function": t["function"]} for t in tools]


def forced_name(tools: list[dict], tool_choice: Any) -> str | None:
    """The tool a named tool_choice asks for (None for "none", "auto", "required"), checked against tools;
    "required" or a name with no tools is a ToolError naming tool_choice."""
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ToolError(f"tool_choice must be one of {TOOL_CHOICES} or {{'type': 'function', 'function': "
                            f"{{'name': ...}}}}, got {tool_choice!r}", "tool_choice")
        if tool_choice == "required" and not tools:
            raise ToolError("tool_choice 'required' needs tools to call; add tools", "tool_choice")
        return None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError(f"tool_choice must be one of {TOOL_CHOICES} or {{'type': 'function', 'function': "
                        f"{{'name': ...}}}}, got {tool_choice!r:.80}", "tool_choice")
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools "
                        f"({', '.join(known) or 'none given'}); name one of them", "tool_choice")
    return name


def _call_tag(fn: dict) -> dict:
    """One Hermes block of this function, its arguments matching its parameters' schema."""
    schema = fn.get("parameters") or {"type": "object"}
    return {"type": "tag", "begin": CALL_BEGIN + json.dumps(fn["name"], ensure_ascii=False) + CALL_ARGS,
            "content": {"type": "json_schema", "json_schema": schema,
                        "max_whitespace_cnt": JSON_MAX_WHITESPACE},
            "end": CALL_END}


def tool_grammar(tools: list[dict], tool_choice: Any, parallel_tool_calls: bool = True,
                 reasoning_tags: tuple[str, str] | None = None) -> StructuredOutputsParams | None:
    """The grammar that enforces a "required" or named tool_choice (None for "none" and "auto"): Hermes
    blocks of the tools (named: exactly one, of that tool; required: one or more, one with
    parallel_tool_calls=False), nothing else. reasoning_tags: the grammar starts after the thinking."""
    name = forced_name(tools, tool_choice)
    if name is None and tool_choice != "required":
        return None
    if name is not None:
        fmt = _call_tag(next(t["function"] for t in tools if t["function"]["name"] == name))
    else:
        fmt = {"type": "tags_with_separator", "tags": [_call_tag(t["function"]) for t in tools],
               "separator": CALL_SEPARATOR, "at_least_one": True, "stop_after_first": not parallel_tool_calls}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt},
                                   reasoning_tags=reasoning_tags)


def parameters_grammars(tools: list[dict]) -> list[tuple[int, StructuredOutputsParams]]:
    """Each tool's parameters schema as a grammar (compiled to check it: a schema the grammar library
    cannot compile is a 400 whatever the tool_choice)."""
    return [(i, StructuredOutputsParams(json=t["function"]["parameters"])) for i, t in enumerate(tools)
            if t["function"].get("parameters")]


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders tools itself (it mentions them)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template if isinstance(template, str) else True


def _arguments(call: dict, i: int) -> dict:
    args = call.get("function", {}).get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise InvalidValueError(f"message {i}'s tool call arguments are not valid JSON ({e}); pass "
                                    "function.arguments as a JSON object in a string") from None
    if not isinstance(args, dict):
        raise InvalidValueError(f"message {i}'s tool call arguments must be a JSON object, got {args!r:.80}")
    return args


def template_inputs(tokenizer: Any, messages: list[dict],
                    tools: list[dict] | None) -> tuple[list[dict], dict[str, Any]]:
    """(messages, template arguments) for the model's chat template: with a template that takes tools,
    `tools` as its argument and each call's arguments as an object (as transformers' templates expect);
    without one, the tools in words (see the module's docstring)."""
    if not isinstance(messages, (list, tuple)):
        return messages, {}
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            m = {**m, "tool_calls": [{**c, "function": {**c.get("function", {}),
                                                        "arguments": _arguments(c, i)}} for c in calls]}
        out.append(m)
    if template_takes_tools(tokenizer):
        return out, ({"tools": tools} if tools else {})
    words = []
    if tools:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            system, out = f"{out[0]['content']}\n\n{system}", out[1:]
        words.append({"role": "system", "content": system})
    for m in out:
        if m.get("role") == "tool":
            answer = message_text(m.get("content") or "", len(words))
            words.append({"role": "user", "content": f"<tool_response>\n{answer}\n</tool_response>"})
        elif m.get("tool_calls"):
            blocks = [CALL_BEGIN + json.dumps(c["function"]["name"], ensure_ascii=False) + CALL_ARGS
                      + json.dumps(c["function"]["arguments"], ensure_ascii=False) + CALL_END
                      for c in m["tool_calls"]]
            text = CALL_SEPARATOR.join([m.get("content") or ""] + blocks).lstrip(CALL_SEPARATOR)
            words.append({"role": "assistant", "content": text})
        else:
            words.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    return words, {}


def render_with_tools(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                      **template_kwargs: Any) -> str:
    """The conversation (and the tools) as the model's chat template writes it, ending with the assistant's
    turn; template_kwargs: the template's own arguments (`enable_thinking`, ...)."""
    messages, extra = template_inputs(tokenizer, messages, check_tools(tools) or None)
    return render_chat(tokenizer, messages, **{**template_kwargs, **extra})
