"""A deliberately small engine that speaks the engine protocol (nanoengine/engine/protocol.py) and shares no
code with LLMEngine's step: transformers' model with its own KV cache per request, greedy, no paging, no
prefix cache, one forward per running request per step. tests/test_engine_protocol.py runs it through `LLM`,
`nanoengine serve --engine small_engine:make_engine` and `nanoengine bench --engine ...`."""

from __future__ import annotations

import time
from itertools import count
from typing import Any

import torch

from nanoengine.assets import resolve_model
from nanoengine.engine.request import Request, new_request
from nanoengine.engine.sequence import SequenceStatus
from nanoengine.engine.step import EngineLoad, StepResult, TextDelta
from nanoengine.errors import InvalidValueError
from nanoengine.tokenizer import load_tokenizer


class Facts:
    """What the server shows of it (EnginePlan's names)."""
    device, dtype, max_model_len, block_size = "cpu", "float32", 512, 16


class SmallEngine:
    def __init__(self, model: str) -> None:
        from transformers import AutoModelForCausalLM

        path = resolve_model(model)
        self.tokenizer = load_tokenizer(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.plan = Facts()
        self.vocab_size = self.model.config.vocab_size
        self.eos = {self.tokenizer.eos_token_id} - {None}
        self.running: dict[str, tuple[Request, Any]] = {}  # request id -> (request, its KV cache or None)
        self.ids = count()

    def make_request(self, prompt: Any, params: Any = None, request_id: str | None = None,
                     final_only: bool = False) -> Request:
        req = new_request(prompt, params, self.tokenizer, self.vocab_size,
                          request_id if request_id is not None else f"small-{next(self.ids)}",
                          final_only=final_only)
        if req.params.n != 1 or req.params.temperature != 0:
            raise InvalidValueError("the small engine decodes one greedy completion (n=1, temperature=0)")
        return req

    def add(self, request: Request) -> None:
        request.seqs[0].status = SequenceStatus.RUNNING
        self.running[request.request_id] = (request, None)

    @torch.inference_mode()
    def step(self) -> StepResult:
        result = StepResult()
        for rid, (req, cache) in list(self.running.items()):
            seq, completion = req.seqs[0], req.completions[0]
            ids = seq.token_ids if cache is None else seq.token_ids[-1:]
            out = self.model(torch.tensor([ids]), cache=cache, use_cache=True)
            self.running[rid] = (req, out.cache)
            token = int(out.logits[0, -1].argmax())
            seq.token_ids.append(token)
            now = time.perf_counter()
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            reason, stop = seq.check_stop(token, self.eos, self.plan.max_model_len)
            delta = completion.push([token], reason is not None)
            if completion.stop_string is not None:
                reason, stop = "stop", completion.stop_string
            result.sampled.append((seq, [token]))
            if delta:
                result.deltas.append(TextDelta(req, 0, delta))
            if reason is not None:
                seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop
                req.metrics.finished_time = now
                result.finished.append(req)
                del self.running[rid]
        return result

    def abort(self, request_id: str) -> None:
        entry = self.running.pop(request_id, None)
        if entry is not None:
            seq = entry[0].seqs[0]
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.running), 0, 0, 0)

    def close(self) -> None:
        self.running.clear()


def make_engine(model: str, **options: Any) -> SmallEngine:
    if options:
        raise InvalidValueError(f"the small engine takes no options, got {sorted(options)}")
    return SmallEngine(model)
