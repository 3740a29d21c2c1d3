"""LLM: the offline API, shaped like vLLM's (`LLM(model).generate(prompts, SamplingParams(...))`).
Chapters 00 and 05.

`generate` takes strings, token-id lists or {"prompt_token_ids": ...} dicts, one SamplingParams or one per
prompt, and returns RequestOutputs in input order. `chat` applies the model's chat template. `stream`
yields text deltas as tokens are produced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from nanoengine.assets import DEFAULT_MODEL
from nanoengine.engine.protocol import check_engine
from nanoengine.errors import InvalidTypeError, InvalidValueError
from nanoengine.launch import build_engine
from nanoengine.outputs import RequestOutput
from nanoengine.sampling_params import SamplingParams
from nanoengine.tokenizer import encode_text


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options: Any) -> None:
        self._attach(build_engine(model, **engine_options))

    @classmethod
    def from_engine(cls, engine: Any) -> LLM:
        """An LLM over an engine already built: ours, or any that speaks the engine protocol
        (nanoengine/engine/protocol.py), such as your own; generate, chat and stream run it alike."""
        llm = cls.__new__(cls)
        llm._attach(check_engine(engine))
        return llm

    def _attach(self, engine: Any) -> None:
        self.engine = engine
        self.config = getattr(engine, "config", None)  # the options as given (EngineConfig)
        self.plan = engine.plan  # what they resolved to on this machine (EnginePlan)
        self.tokenizer = engine.tokenizer
        self.trace = None  # RunTrace of the last generate() when trace=True
        self.last_run_stats: dict[str, Any] = {}

    def get_tokenizer(self):
        return self.tokenizer

    def collective_rpc(self, method: str | Callable, *args: Any) -> list[Any]:
        """A ModelRunner method, or fn(runner, *args), on every rank (Executor.collective_rpc)."""
        return self.engine.executor.collective_rpc(method, *args)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes now (distributed/workers.py); no-op with one process."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[Any]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidTypeError("prompts must be a string, a dict, a list of token ids, "
                                   f"or a list of those; got {type(prompts).__name__}")
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = self._as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InvalidValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} "
                                        "prompts; pass one for all or one per prompt")
            params = list(sampling_params)
        else:
            params = [SamplingParams() if sampling_params is None else sampling_params] * len(prompts)
        engine = self.engine
        # check every request before queueing any, so one bad prompt leaves nothing half-added
        requests = [engine.make_request(p, sp, final_only=True) for p, sp in zip(prompts, params)]
        bar = None
        steps = 0
        try:  # (a failure while adding them, too, leaves none of them queued)
            if getattr(self.plan, "trace", False):  # (an engine of one's own may keep no trace)
                self.trace = engine.start_trace()
            for r in requests:
                engine.add(r)
            if hasattr(engine, "clear_stats"):  # a run's own StepStats (an engine that keeps them)
                engine.clear_stats()
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
            t0 = time.perf_counter()
            while any(not r.finished for r in requests):
                steps += engine.step().stats is not None
                if bar is not None:
                    done = sum(r.finished for r in requests)
                    if done != bar.n:
                        bar.update(done - bar.n)
            seconds = time.perf_counter() - t0
            outputs = [r.output() for r in requests]
        except BaseException as error:
            self._let_go(requests, error)  # after Ctrl-C this also aborts the unfinished ones
            raise
        finally:
            if bar is not None:
                bar.close()
        steps += self._let_go(requests)  # the engine forgets them
        n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        n_in = sum(len(o.prompt_token_ids) for o in outputs)
        self.last_run_stats = {"num_requests": len(outputs), "prompt_tokens": n_in, "output_tokens": n_out,
                               "seconds": seconds, "output_tokens_per_s": n_out / max(seconds, 1e-9),
                               "total_tokens_per_s": (n_in + n_out) / max(seconds, 1e-9),
                               "steps": steps}
        if self.trace is not None:
            engine.stop_trace()
        return outputs

    def _let_go(self, requests: list, error: BaseException | None = None) -> int:
        """Abort `requests` (finished ones just let go) and finish a step still in flight (overlap), so the
        engine is idle; returns the steps that finished. `error`: the one propagating meanwhile, which stays
        the one raised (an error here is noted on it)."""
        engine = self.engine
        try:
            for r in requests:
                engine.abort(r.request_id)
            drain = getattr(engine, "drain", None)  # a step launched before they finished (overlap)
            return int(drain is not None and drain().stats is not None)
        except BaseException as e:
            if error is None:
                raise
            error.add_note(f"nanoengine: letting go of the requests failed too: {type(e).__name__}: {e}")
            return 0

    def _chat_prompts(self, messages: Any, chat_template_kwargs: dict | None,
                      tools: list[dict] | None = None) -> list[dict]:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidTypeError("chat takes a conversation (a non-empty list of {'role', 'content'} "
                                   f"dicts) or a list of conversations; got {messages!r:.80}")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise InvalidTypeError("chat_template_kwargs must be a dict, got "
                                   f"{type(chat_template_kwargs).__name__}")
        from nanoengine.tools import render_with_tools

        texts = [render_with_tools(self.tokenizer, c, tools, **(chat_template_kwargs or {})) for c in convs]
        return [{"prompt_token_ids": encode_text(self.tokenizer, t, "conversation", add_special_tokens=False)}
                for t in texts]

    def chat(self, messages: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts; an agent's too: assistant messages with
        `tool_calls`, "tool" messages with `tool_call_id`) or a list of conversations. tools: OpenAI's
        function tools, for the template (a template without tools gets them in words: nanoengine/tools.py);
        chat_template_kwargs: the template's arguments (e.g. {"enable_thinking": False}). The outputs are
        vLLM's RequestOutputs; `parse_chat_outputs` reads their thinking and tool calls."""
        return self.generate(self._chat_prompts(messages, chat_template_kwargs, tools), sampling_params,
                             use_tqdm)

    def parse_chat_outputs(self, outputs: list[RequestOutput], reasoning_parser: str | None = "qwen3",
                           tool_parser: str | None = "hermes") -> list[list[Any]]:
        """Each chat output's completions read by the parsers (nanoengine/parsers.py): a ParsedChat each, with
        `reasoning_content`, `content`, `tool_calls` and `finish_reason`, and `.message()` (the assistant
        message for the next turn), as the server's reply would have them."""
        from nanoengine.parsers import parse_chat_output

        return [parse_chat_output(o, reasoning_parser, tool_parser, self.tokenizer) for o in outputs]

    def stream(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion's text deltas as they are produced (first completion when n > 1)."""
        engine = self.engine
        req = engine.make_request(prompt, sampling_params)
        try:
            engine.add(req)
            while not req.finished:
                for r, i, delta in engine.step().deltas:
                    if r is req and i == 0:
                        yield delta
        except BaseException as error:  # (GeneratorExit too: the caller stopped reading)
            self._let_go([req], error)
            raise
        self._let_go([req])

    def stream_chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                    chat_template_kwargs: dict | None = None) -> Iterator[str]:
        yield from self.stream(self._chat_prompts(messages, chat_template_kwargs)[0], sampling_params)
