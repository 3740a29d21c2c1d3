"""Request bodies of the server, in OpenAI's shapes (pydantic); the responses are in `serve/responses.py`.
Chapter 05 (appendix).

Requests are parsed strictly (a string is not a number, `true` is not an integer) and unknown fields are
refused, so nothing is accepted and ignored. Pydantic checks the shape; the values are checked where the
engine checks them, by `SamplingParams` (ranges, with a message naming the field) and by the engine's
admission (prompt length against `max_model_len`). Fields OpenAI has and nanoengine does not implement
(penalties, best_of, suffix) are accepted only at their neutral value. Logprobs are OpenAI's two shapes:
/v1/completions' legacy `logprobs: k` (with `echo`, the prompt's too; `max_tokens: 0` with echo scores the
prompt alone, as vLLM does) and chat's `logprobs: true` + `top_logprobs: k`; k is at most the engine's
`max_logprobs` (`serve/logprobs.py` builds them). vLLM's extra sampling fields (`top_k`, `min_p`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, ...) are accepted too; the `openai` client sends them through
`extra_body`. Structured outputs (nanoengine/structured.py): OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, one of
them per request, become `SamplingParams.structured_outputs`.

Agents (nanoengine/parsers.py, nanoengine/tools.py): a chat takes vLLM's `chat_template_kwargs` (e.g.
`{"enable_thinking": false}`), OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, assistant messages
with `tool_calls` and "tool" messages with `tool_call_id`. A reply's message (or a chunk's delta) has
`reasoning_content` beside `content` with a reasoning parser, and `tool_calls` when the model called tools.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoengine.errors import InvalidTypeError, InvalidValueError
from nanoengine.sampling_params import SamplingParams
from nanoengine.structured import StructuredOutputsParams
from nanoengine.tokenizer import check_messages, message_text
from nanoengine.tools import ToolError, check_tools, tool_grammar

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's default is "up to max_model_len"


class ProtocolError(InvalidValueError):
    """A request the server refuses (HTTP 400), with the field it is about."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`."""
    name: str
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's request field `structured_outputs` (StructuredOutputsParams' fields: give one)."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # vLLM's older names for structured_outputs' fields


class _GenerationRequest(_Strict):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id (OpenAI uses it for abuse monitoring); kept out of the engine
    presence_penalty: float | None = None  # accepted at 0 only
    frequency_penalty: float | None = None  # accepted at 0 only
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # structured outputs (nanoengine/structured.py): OpenAI's response_format, vLLM's structured_outputs,
    # and vLLM's older guided_* fields; at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _check_neutral(self, **fields: Any) -> None:
        """Refuse fields nanoengine does not implement unless they hold their neutral value."""
        for name, neutral in fields.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ProtocolError(f"{name}={value!r} is not supported by nanoengine; leave it out "
                                    f"(or {neutral!r})", name)

    def sampling_params(self, default_max_tokens: int | None, **extra: Any) -> SamplingParams:
        """The request's SamplingParams (OpenAI's defaults where a field is left out; `extra`: fields an
        endpoint decides, over those); SamplingParams checks every value and names the field in its error."""
        self._check_neutral(presence_penalty=0.0, frequency_penalty=0.0)
        fields = {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "min_p": self.min_p, "seed": self.seed, "stop": self.stop, "min_tokens": self.min_tokens,
                  "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                  "skip_special_tokens": self.skip_special_tokens,
                  "include_stop_str_in_output": self.include_stop_str_in_output}
        given = {k: v for k, v in fields.items() if v is not None}
        if (structured := self.structured_outputs_params()) is not None:
            given["structured_outputs"] = structured
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return SamplingParams(**{"max_tokens": max_tokens, **given, **extra})

    def structured_field(self) -> str | None:
        """The request field that asks for structured outputs (None: none does); two at once is a 400."""
        given = [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
                 if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")  # plain text: nothing to constrain
        if len(given) > 1:
            raise ProtocolError(f"give one way to constrain the output, not {' and '.join(given)}", given[1])
        return given[0] if given else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The StructuredOutputsParams the request asks for, whichever field it used."""
        name = self.structured_field()
        if name is None:
            return None
        fmt = self.response_format
        if name == "response_format" and fmt.type == "json_schema" and (
                fmt.json_schema is None or fmt.json_schema.json_schema is None):
            raise ProtocolError("response_format of type json_schema needs json_schema.schema (the JSON "
                                "schema the output must match)", name)
        try:
            if name == "response_format":
                if fmt.type == "json_object":
                    return StructuredOutputsParams(json_object=True)
                return StructuredOutputsParams(json=fmt.json_schema.json_schema)
            if name == "structured_outputs":
                body = self.structured_outputs
                return StructuredOutputsParams(json=body.json_, regex=body.regex, choice=body.choice,
                                               grammar=body.grammar, json_object=body.json_object)
            return StructuredOutputsParams(**{GUIDED_FIELDS[name]: getattr(self, name)})
        except (InvalidValueError, TypeError) as e:
            raise ProtocolError(f"{name}: {e}", name) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # each token's logprob and the top `logprobs` (OpenAI's legacy shape)
    echo: bool | None = None  # the prompt before the completion (with logprobs, the prompt's logprobs first)
    best_of: int | None = None  # None or n
    suffix: str | None = None  # None only

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone (vLLM generates one token and drops it)."""
        return bool(self.echo) and self.max_tokens == 0

    def sampling_params(self, default_max_tokens: int | None, **extra: Any) -> SamplingParams:
        """With logprobs=k, the top k of each generated token, and with echo of each prompt token too."""
        if self.max_tokens == 0 and not self.echo:
            raise ProtocolError("max_tokens=0 generates nothing; ask for at least 1 token, or add echo=true "
                                "to score the prompt alone", "max_tokens")
        extra = {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None, **extra}
        if self.echo_only:
            extra["max_tokens"] = 1
        return super().sampling_params(default_max_tokens, **extra)

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: a string, a list of token ids, or a list of either (one request each)."""
        self._check_neutral(suffix=None)
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ProtocolError(f"best_of={self.best_of} is not supported by nanoengine; leave it out",
                                "best_of")
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ProtocolError("prompt is empty: give a string, a list of token ids, or a list of those",
                                "prompt")
        return list(p)


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallIn(_Strict):
    """A call in an earlier assistant message."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(_Strict):
    # a string, or OpenAI's list of content parts: {"type": "text", "text": ...} parts are joined; any other
    # type (image_url, input_audio, file, ...) is refused by name in `text` (a dict here, so that the error
    # names the part's type instead of pydantic's "Input should be a valid string")
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self, i: int) -> str | None:
        """This message's content as one string (it is message `i`); a part that is not text is a 400."""
        if self.content is None:
            return None
        try:
            return message_text(self.content, i)
        except (InvalidValueError, InvalidTypeError) as e:
            raise ProtocolError(str(e), "messages") from None


class SystemMessage(_Message):
    role: Literal["system"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[dict[str, Any]] | None = None  # None: a message that only calls tools
    tool_calls: list[ToolCallIn] | None = None
    reasoning_content: str | None = None  # its thinking (a template may show it)


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str  # the call it answers


# OpenAI's four kinds of message, told apart by their role
ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (an object's)
    strict: bool | None = None  # a forced call always follows the schema


class Tool(_Strict):
    """OpenAI's function tool."""
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice {"type": "function", "function": {"name": ...}}: exactly this call."""
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # each token's logprob (and with top_logprobs, the k most likely)
    top_logprobs: int | None = None  # k, with logprobs=true only (OpenAI's rule)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's arguments (enable_thinking)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # with "required": False allows one call only

    def sampling_params(self, default_max_tokens: int | None, reasoning_tags: tuple[str, str] | None = None,
                        auto_tool_choice: bool = False, **extra: Any) -> SamplingParams:
        """With logprobs=true, each generated token's logprob and the top `top_logprobs` (0 when left out).
        A "required" or named tool_choice is a grammar (tools.tool_grammar); with `reasoning_tags` (the
        server's reasoning parser) a grammar applies only after the thinking."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs=true; add it, or leave top_logprobs out",
                                "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ProtocolError(f"top_logprobs must be >= 0, got {self.top_logprobs}", "top_logprobs")
        extra = {"logprobs": (self.top_logprobs or 0) if self.logprobs else None, **extra}
        structured = self.structured_outputs_params()
        tools = self.tool_list()
        try:
            grammar = tool_grammar(tools, self.effective_tool_choice(auto_tool_choice),
                                   self.parallel_tool_calls is not False, reasoning_tags)
        except ToolError as e:
            raise ProtocolError(str(e), e.param) from None
        if grammar is not None and structured is not None:
            raise ProtocolError(f"tool_choice {self.tool_choice_name()!r} and {self.structured_field()} both "
                                "constrain the output; give one", "tool_choice")
        if grammar is not None:
            extra["structured_outputs"] = grammar
        elif structured is not None and reasoning_tags is not None:
            extra["structured_outputs"] = dataclasses.replace(structured, reasoning_tags=reasoning_tags)
        return super().sampling_params(default_max_tokens, **extra)

    def tool_list(self) -> list[dict[str, Any]]:
        """The tools as dicts (OpenAI's shape), checked (a bad name is a 400 naming `tools`)."""
        try:
            return check_tools([t.model_dump(exclude_none=True) for t in self.tools or ()])
        except ToolError as e:
            raise ProtocolError(str(e), e.param) from None

    def tool_choice_name(self) -> str:
        c = self.tool_choice
        return c if isinstance(c, str) or c is None else c.function.name

    def effective_tool_choice(self, auto_tool_choice: bool) -> str | dict[str, Any]:
        """The request's tool_choice; left out: "auto" with tools on a server that reads calls
        (--enable-auto-tool-choice), else "none" (vLLM's rule). "auto" asked of a server that does not read
        calls is a 400."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools and auto_tool_choice else "none"
        if choice == "auto" and self.tools and not auto_tool_choice:
            raise ProtocolError('tool_choice "auto" needs a server that reads the calls: start it with '
                                "--enable-auto-tool-choice --tool-call-parser hermes, or ask for "
                                '"required" or a named function', "tool_choice")
        return choice if isinstance(choice, str) else choice.model_dump()

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (an assistant's calls and a tool's call id too)."""
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ProtocolError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        messages = []
        for i, m in enumerate(self.messages):
            d: dict[str, Any] = {"role": m.role, "content": m.text(i)}
            if getattr(m, "tool_calls", None):
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            for name in ("tool_call_id", "reasoning_content"):
                if getattr(m, name, None) is not None:
                    d[name] = getattr(m, name)
            messages.append(d)
        try:
            return check_messages(messages)
        except (InvalidValueError, InvalidTypeError) as e:
            raise ProtocolError(str(e), "messages") from None
