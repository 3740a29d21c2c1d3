"""nanoengine/viz/moe.py (chapter 10): the routing recorded by hooks on a real run of tiny-qwen3-moe, against
the engine's own step counts and the blocks' router recomputed by hand; the view's layer slider."""

from __future__ import annotations

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.errors import InvalidValueError
from nanoengine.layers.moe import SparseMoeBlock
from nanoengine.viz.moe import RoutingView, record_routing

pytestmark = pytest.mark.xdist_group("tiny")


def test_record_routing_counts_every_token_of_every_step_and_view_moves_over_layers():
    llm = LLM("tiny-qwen3-moe", dtype="float32", max_num_batched_tokens=16)
    model = llm.engine.executor.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    seen = []
    handle = blocks[1].register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].detach().clone()))
    with record_routing(model) as record:
        llm.generate(["The capital of France is a city", "def f(x):"],
                     SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    handle.remove()
    k = blocks[0].top_k
    steps = [s.prefill_tokens + s.decode_tokens for s in llm.engine.stats]
    counts = record.counts  # [F, L, E]
    assert counts.shape == (len(steps), len(blocks), blocks[0].experts.num_experts)
    assert counts.sum(-1).tolist() == [[n * k] * len(blocks) for n in steps]  # chunked prefills included
    for f, x in enumerate(seen):  # layer 1's ids: its router recomputed on the inputs it saw
        with torch.inference_mode():
            probs = torch.softmax(x @ blocks[1].gate.weight.T, dim=-1)  # [T, E]
        assert torch.equal(record.forwards[f][1].sort(-1).values, probs.topk(k, -1).indices.sort(-1).values)
    imb = record.imbalance
    assert torch.allclose(imb, counts.double().amax(-1) / counts.double().mean(-1))
    assert all(not b.gate._forward_hooks for b in blocks)  # the hooks are gone after the `with`

    view = RoutingView(record)
    first = view.children[1].value
    view.children[0].value = 2  # the slider
    assert view.layer == 2 and view.children[1].value != first and "layers.2.mlp" in view.children[1].value
    with pytest.raises(InvalidValueError, match="not in 0..3"):
        view.layer = 9


def test_record_routing_refuses_a_dense_model():
    with pytest.raises(InvalidValueError, match="no SparseMoeBlock"):
        with record_routing(torch.nn.Linear(2, 2)):
            pass
