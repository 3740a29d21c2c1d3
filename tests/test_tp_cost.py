"""The decode cost model of tensor parallelism (nanoengine/bench/tp_cost.py, chapter 07): its weight counts
against the models' published parameter counts, its communication against arithmetic done by hand, the
break-even batch at its edge, and the gloo all-reduce measured on two real processes."""

from __future__ import annotations

import pytest

from nanoengine.bench.tp_cost import (
    NVLINK_H100,
    PCIE4_X16,
    QWEN3_0_6B,
    QWEN3_8B,
    Link,
    break_even_batch,
    decode_tp_cost,
    measure_gloo_all_reduce,
)


def test_the_shapes_have_the_published_non_embedding_parameter_counts():
    # the model cards: Qwen3-0.6B 0.44B non-embedding parameters, Qwen3-8B 6.95B
    assert round(QWEN3_0_6B.linear_params / 1e9, 2) == 0.44
    assert round(QWEN3_8B.linear_params / 1e9, 2) == 6.95


def test_one_step_by_hand():
    link = Link("test", bandwidth=1e9, latency=1e-5)
    c = decode_tp_cost(QWEN3_0_6B, link, batch=4, ranks=2, memory_bandwidth=1e12)
    assert c.all_reduces == 2 * 28 + 1
    assert c.all_reduced_bytes == 57 * 4 * 1024 * 2  # [batch, hidden] bf16, 57 times
    assert c.gathered_bytes == 4 * 151936 * 4
    linear = (QWEN3_0_6B.linear_params + 151936 * 1024) * 2  # the tied table is read once, as the LM head
    assert c.weight_bytes_saved_per_rank == linear // 2
    assert c.saved_time == pytest.approx(linear / 2 / 1e12)
    # a ring all-reduce over 2 ranks sends each message once from every rank; the gather sends half the logits
    want = 57 * (1e-5 + 4 * 1024 * 2 / 1e9) + 1e-5 + 0.5 * 4 * 151936 * 4 / 1e9
    assert c.comm_time == pytest.approx(want)
    assert c.pays == (c.saved_time > want)


def test_break_even_batch_is_the_edge_and_the_links_order_as_expected():
    for shape in (QWEN3_0_6B, QWEN3_8B):
        for link in (PCIE4_X16, NVLINK_H100):
            b = break_even_batch(shape, link)
            if b:
                assert decode_tp_cost(shape, link, b).pays and not decode_tp_cost(shape, link, b + 1).pays
            else:
                assert not decode_tp_cost(shape, link, 1).pays
    # with these assumptions TP=2 never pays for Qwen3-0.6B's decode, and pays for Qwen3-8B's at small batches
    assert break_even_batch(QWEN3_0_6B, NVLINK_H100) == 0
    assert 0 < break_even_batch(QWEN3_8B, PCIE4_X16) < break_even_batch(QWEN3_8B, NVLINK_H100)
    with pytest.raises(ValueError, match="ranks"):
        decode_tp_cost(QWEN3_8B, NVLINK_H100, batch=1, ranks=1)


@pytest.mark.xdist_group("notebooks")  # it starts two processes
def test_gloo_all_reduce_is_measured_on_two_processes():
    measured = measure_gloo_all_reduce(batches=(1, 64), hidden=256, iters=5)
    assert set(measured) == {1, 64} and all(0 < t < 5 for t in measured.values())
