"""Response bodies of the server, in OpenAI's shapes (pydantic): completions and chat completions, whole and
streamed (chunks), with usage and logprobs (OpenAI's two shapes, filled by `serve/logprobs.py`), plus the
model list, `/server_info` and errors. Chapter 05 (appendix). The requests are in `serve/protocol.py`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs of a completion's tokens (with echo, the prompt's first): each token's text,
    its logprob (None for the prompt's first token: nothing predicts it), {token: logprob} of it and the top
    k, and where its text starts in the choice's text."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)  # the k most likely, by rank


class ChatLogprobs(BaseModel):
    """A chat choice's logprobs (OpenAI's shape): one entry per generated token."""
    content: list[TokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with a reasoning parser: the thinking
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call: its first chunk has the id, type and name (arguments ""), the next ones arguments."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "nanoengine"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ServerInfo(BaseModel):
    """GET /server_info: what the engine was planned with (vLLM has this route too). The data-parallel front
    end reads its replicas' block size and batch size here. An engine of one's own (engine/protocol.py)
    states what it has; the rest is null."""
    model: str  # the served name
    block_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int
    enable_prefix_caching: bool | None = None
    device: str | None = None
    dtype: str | None = None
    attention_backend: str | None = None
    tensor_parallel_size: int | None = None
    decode_mode: str | None = None
    async_scheduling: bool | None = None
    quantization: str | None = None

    @classmethod
    def of(cls, model_name: str, plan: Any, num_kv_blocks: int) -> ServerInfo:
        """From the engine's plan (an EnginePlan, or the facts an engine of one's own states) and its KV
        pool."""
        planned = {name: getattr(plan, name) for name in cls.model_fields if hasattr(plan, name)}
        if "decode_mode" in planned:
            planned["decode_mode"] = str(planned["decode_mode"])
        return cls(**{**planned, "model": model_name, "num_kv_blocks": num_kv_blocks})


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
