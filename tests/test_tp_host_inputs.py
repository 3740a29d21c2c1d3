"""Under tensor parallelism rank 0 sends each step's inputs to the other ranks from the input builder's host
buffers, never by copying its device inputs back to the host (on CUDA that copy waits for the step in flight,
so overlap could never run ahead). On CPU host and device are the same memory, so these tests follow the
code path: a "device" input on the meta device (a meta tensor cannot be copied to the host at all), and a
TP=2 engine whose device inputs are separate copies that rank 0 must never read to send."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from tp_workload import GREEDY, PROMPTS

from nanoengine.distributed import ranks
from nanoengine.distributed.channel import Call, to_device
from nanoengine.distributed.ranks import Ranks
from nanoengine.engine.inputs import InputBuilder, ModelInput, tensors_of
from nanoengine.engine.scheduler import ScheduledSeq
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams


class Recorded(Ranks):
    """Ranks that keep what rank 0 delivers instead of sending it."""
    size = 2

    def __init__(self) -> None:
        self.delivered: list[Call] = []

    def deliver(self, message):
        self.delivered.append(message)

    def replies(self):
        return []

    def failure(self, within_s, during):
        return None

    def close(self):
        pass

    def kill(self):
        pass


def built_step() -> ModelInput:
    """A step with a decode and a prefill chunk, built into the builder's host buffers."""
    decoding = Sequence(list(range(100, 110)), SamplingParams(), 4)
    decoding.block_table, decoding.num_computed_tokens = [7, 3, 9], 9
    chunk = Sequence(list(range(200, 212)), SamplingParams(), 4)
    chunk.block_table = [1, 5, 6]
    inp = InputBuilder(4).build([ScheduledSeq(chunk, 6, True), ScheduledSeq(decoding, 1, False)]).inputs
    return inp


def test_a_device_input_keeps_its_host_input_and_is_sent_from_it():
    host = built_step()
    device = host.to("meta")  # stands for a CUDA copy: reading it back to the host is what must not happen
    assert device.host is host and host.host_side() is host and device.host_side() is host
    with pytest.raises((NotImplementedError, RuntimeError)):  # the detector: a device->host copy fails
        to_device(device, "cpu", copy=True)
    ranks = Recorded()
    ranks.send("execute", (device,))
    (sent,) = ranks.delivered[0].args
    assert isinstance(sent, ModelInput) and sent.host is None  # (the host field never travels)
    for got, want in zip(tensors_of(sent), tensors_of(host), strict=True):
        assert got.device.type == "cpu" and torch.equal(got, want)
        # a copy of its own elements (a view of the buffers would pickle all of them)
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size()
    assert sent.prev_sampled == host.prev_sampled and sent.attn.num_decode_seqs == host.attn.num_decode_seqs


def test_an_input_with_other_tensors_has_no_host_input():
    """dataclasses.replace (prompt_logits' every-row input, the runner's pending ids) makes an input whose
    tensors differ from the host buffers': it must not claim them."""
    device = built_step().to("meta")
    replaced = dataclasses.replace(device, sample_rows=torch.arange(3, device="meta"))
    assert replaced.host is None and replaced.host_side() is replaced


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local TP workers need Linux's pidfd")
def test_a_tp_engine_sends_the_host_inputs_not_the_device_ones(monkeypatch):
    """TP=2 over gloo, each step's "device" inputs a separate copy (as on CUDA): what rank 0 sends is read
    from the host buffers only, and the tokens are one process's."""
    from nanoengine import LLM

    with LLM("tiny-qwen3", dtype="float32") as one:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]

    devices: list[ModelInput] = []  # every step's device input and host input (kept: ids stay unique)
    hosts: list[ModelInput] = []

    def to_separate_device(self, inp):
        device = to_device(inp, "cpu", copy=True)  # (its own memory, as a CUDA copy would be)
        device.host = inp
        devices.append(device)
        hosts.append(inp)
        return device

    sent: list[ModelInput] = []
    real = ranks.to_device

    def watched(obj, device, copy=False):  # what Ranks.send reads its message from
        sent.extend(a for a in (obj if isinstance(obj, tuple) else (obj,)) if isinstance(a, ModelInput))
        return real(obj, device, copy)

    monkeypatch.setattr(InputBuilder, "to_device", to_separate_device)
    monkeypatch.setattr(ranks, "to_device", watched)
    with LLM("tiny-qwen3", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=32) as two:
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    assert len(sent) == len(devices) > 0, "every step goes to the other rank"
    assert not any(any(s is d for d in devices) for s in sent), (
        "rank 0 sent a step from its device inputs (a device-to-host copy)")
    assert all(s is h for s, h in zip(sent, hosts)), "each step is sent from its own host input"


@pytest.mark.gpu
def test_sending_a_cuda_step_never_waits_for_the_device():
    """On CUDA, with work in flight: sending a step the input builder laid out makes no synchronizing call
    (torch's sync debug mode raises on one: a device-to-host copy of the step's inputs would)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    decoding = Sequence(list(range(100, 110)), SamplingParams(), 4)
    decoding.block_table, decoding.num_computed_tokens = [7, 3, 9], 9
    inp = InputBuilder(4, device="cuda").build([ScheduledSeq(decoding, 1, False)]).inputs
    assert inp.input_ids.is_cuda and inp.host is not None and not inp.host.input_ids.is_cuda
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # a step in flight
        x = torch.tanh(x @ x)
    ranks = Recorded()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ranks.send("execute", (inp,))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    (sent,) = ranks.delivered[0].args
    assert sent.input_ids.tolist() == [109]
