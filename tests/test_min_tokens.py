"""`min_tokens` as vLLM: a sequence's stop ids (its `stop_token_ids`, and the end-of-sequence ids unless
`ignore_eos`) are masked in the logits until it has `min_tokens` output tokens, so they are never drawn; stop
strings count only after it. Checked on the mask's rows, on a hand-checked distribution, and in the engine
with logprobs (processed ones show the mask), speculative decoding and structured outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.engine.logits_masks import BannedTokens, chain, min_tokens_mask
from nanoengine.engine.sequence import Sequence
from nanoengine.layers.sampler import Sampler, SamplingBatch
from nanoengine.structured import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).resolve().parent / "exercises"))
from ex_helpers import chi_square  # noqa: E402  (the exercises' statistics)

pytestmark = pytest.mark.xdist_group("min_tokens")
EOS = 2
SAY_HI = [{"role": "user", "content": "Say hi."}]  # SmolLM2 answers in 24 tokens, the last one EOS


# ------------------------------------------------------------------------------------------- the mask's rows
def seq(prompt: int, made: int, **params) -> Sequence:
    s = Sequence(list(range(prompt + made)), SamplingParams(max_tokens=50, **params), block_size=4)
    s.num_prompt_tokens = prompt
    s.num_pending_tokens = 1  # committed: the step samples its next token
    return s


def banned(mask) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r, t in zip(mask.rows.tolist(), mask.token_ids.tolist()):
        out.setdefault(r, []).append(t)
    return out


def test_rows_before_min_tokens_cannot_draw_their_stop_ids():
    a = seq(5, 2, min_tokens=3)  # its third output token: held back
    b = seq(5, 3, min_tokens=3)  # its fourth: free
    c = seq(5, 0, min_tokens=1, stop_token_ids=[7], ignore_eos=True)  # its first: only its own stop id
    d = seq(5, 0)  # no min_tokens
    mask = min_tokens_mask([a, b, c, d], [EOS], vocab_size=100)
    assert banned(mask) == {0: [EOS], 2: [7]}


def test_a_verifying_sequences_rows_count_their_drafts():
    s = seq(4, 1, min_tokens=3)  # rows predict output tokens 2, 3, 4: the first two held back
    mask = min_tokens_mask([s, s, s], [EOS, 3], vocab_size=100)
    assert banned(mask) == {0: [EOS, 3], 1: [EOS, 3]}


def test_a_grammar_that_can_only_end_keeps_its_stop_ids():
    class Grammar:  # a TokenMask whose row 0 allows only EOS, row 1 also token 40
        rows = [0, 1]
        bitmask = torch.zeros(2, 4, dtype=torch.int32)

    Grammar.bitmask[:, 0] = 1 << EOS
    Grammar.bitmask[1, 1] = 1 << (40 - 32)
    s, t = seq(3, 0, min_tokens=4), seq(3, 0, min_tokens=4)
    assert banned(min_tokens_mask([s, t], [EOS], 128, Grammar)) == {1: [EOS]}


def test_the_masks_chain_and_leave_the_raw_logits_alone():
    logits = torch.zeros(2, 5)
    first, second = BannedTokens(torch.tensor([0]), torch.tensor([1])), BannedTokens(torch.tensor([1]),
                                                                                       torch.tensor([4]))
    masked = chain(None, first, second).apply(logits)
    assert torch.isinf(masked).nonzero().tolist() == [[0, 1], [1, 4]] and not torch.isinf(logits).any()
    assert chain(None, None) is None and chain(first) is first


def test_draws_follow_the_distribution_without_the_held_back_ids():
    """Hand-checked: logits log([0.1, 0.2, 0.3, 0.4]) with token 3 (the likeliest) held back: the draws follow
    [1/6, 2/6, 3/6, 0]."""
    torch.manual_seed(0)
    n = 6000
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).repeat(n, 1)  # [n, 4]
    mask = BannedTokens(torch.arange(n), torch.full((n,), 3))
    gen = torch.Generator().manual_seed(1)
    batch = SamplingBatch(temperatures=torch.ones(n), top_ks=None, top_ps=None, min_ps=None,
                          generators=[gen] + [None] * (n - 1), all_greedy=False, any_greedy=False)
    tokens = Sampler(seed=2)(mask.apply(logits), batch)  # [n]
    assert not (tokens == 3).any()
    assert chi_square(tokens, torch.tensor([1 / 6, 2 / 6, 3 / 6, 1e-12])) < 13.8  # chi2(2 dof), p = 0.001


# ------------------------------------------------------------------------------------------- in the engine
@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", dtype="float32", block_size=16)


@pytest.fixture(scope="module")
def plain(llm):
    out = llm.chat(SAY_HI, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS and len(out.token_ids) < 40
    return out.token_ids


def test_no_eos_before_min_tokens_and_the_same_greedy_text_up_to_it(llm, plain):
    min_tokens = len(plain) + 3
    out = llm.chat(SAY_HI, SamplingParams(temperature=0, max_tokens=64, min_tokens=min_tokens),
                   use_tqdm=False)[0].outputs[0]
    assert EOS not in out.token_ids[:min_tokens] and len(out.token_ids) >= min_tokens
    assert out.token_ids[:len(plain) - 1] == plain[:-1]  # the same tokens until the EOS it could not draw
    assert out.token_ids[len(plain) - 1] != EOS


def test_a_stop_token_id_is_held_back_too(llm, plain):
    stop = plain[5]  # a token it would draw as its sixth
    out = llm.chat(SAY_HI, SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[stop], min_tokens=8),
                   use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:8] and out.token_ids[:5] == plain[:5]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_processed_logprobs_show_the_mask(plain, mode):
    llm = LLM("smollm2-135m", dtype="float32", block_size=16, logprobs_mode=mode)
    where = len(plain) - 1  # the position where it drew EOS without min_tokens
    out = llm.chat(SAY_HI, SamplingParams(temperature=0, max_tokens=where + 4, min_tokens=where + 3,
                                          logprobs=3), use_tqdm=False)[0].outputs[0]
    at = out.logprobs[where]
    if mode == "raw_logprobs":
        assert at[EOS].rank == 1  # the model's own distribution: EOS first
    else:
        assert EOS not in at  # the distribution drawn from: EOS at -inf, out of the top 3
        assert sum(torch.tensor([v.logprob for v in at.values()]).exp()) <= 1.0 + 1e-5


def test_speculative_decoding_gives_the_same_tokens(llm, plain):
    params = SamplingParams(temperature=0, max_tokens=48, min_tokens=len(plain) + 3)
    want = llm.chat(SAY_HI, params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM("smollm2-135m", dtype="float32", block_size=16,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "row_cost": 0.15})
    got = spec.chat(SAY_HI, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want and EOS not in got[:len(plain) + 3]


def test_structured_outputs_and_min_tokens(llm):
    words = StructuredOutputsParams(regex="[a-z ]{1,40}")
    out = llm.chat(SAY_HI, SamplingParams(temperature=0, max_tokens=30, min_tokens=6,
                                          structured_outputs=words), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 6 and EOS not in out.token_ids[:6]
    assert out.text and set(out.text) <= set("abcdefghijklmnopqrstuvwxyz ")
    # a grammar that can only end before min_tokens ends there (nothing else could be drawn)
    done = llm.chat(SAY_HI, SamplingParams(temperature=0, max_tokens=30, min_tokens=10,
                                           structured_outputs=StructuredOutputsParams(choice=["yes"])),
                    use_tqdm=False)[0].outputs[0]
    assert done.text == "yes" and done.finish_reason == "stop"
