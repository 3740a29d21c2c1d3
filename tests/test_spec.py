"""Speculative decoding (chapter 09): the n-gram proposer, the acceptance rules, and exactness.

- the proposer, the greedy acceptance rule and the options: plain Python, milliseconds;
- rejection sampling: the accepted token is distributed as the target's p (chi-square on a small vocabulary,
  fixed seed), for a real draft distribution q and for a point mass (the n-gram case);
- exactness of the engine: greedy output with speculation equals greedy output without, token for token,
  through chunked prefill, prefix hits, preemption, stop strings and ids, and batches mixing speculating and
  plain sequences. The model is a stub over a fake KV cache whose every slot holds the token prefix its K/V
  were computed for (the oracle): a rolled-back slot read later, a rejected draft's K/V in a cached block, or
  a wrong block table changes a later token. A proposer that knows the answer and corrupts some drafts makes
  every acceptance length happen. Then the same on tiny-qwen3 through the real attention path, and with a
  draft model: tiny-qwen3 with noise on its weights, which agrees with it on some tokens, not all.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.bench.host import StubExecutor, stub_engine
from nanoengine.config import EngineConfig, SpeculativeConfig
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.inputs import ModelInput
from nanoengine.errors import InvalidValueError
from nanoengine.spec.ngram import NgramProposer
from nanoengine.spec.policy import (
    MAX_PROBE_INTERVAL,
    PROBE_INTERVAL,
    VERIFY_ROW_COST,
    AdaptiveK,
    StepCost,
    best_k,
)
from nanoengine.spec.verify import accepted_tokens, rejection_sample

sys.path.insert(0, str(Path(__file__).resolve().parent / "exercises"))
from ex_helpers import CHI2_P001, chi_square  # noqa: E402  (the exercises' statistics, shared)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# the drafts' cost fixed: measured, which steps draft would depend on each step's timing (not the tokens)
FIXED_NGRAM = {**NGRAM, "row_cost": VERIFY_ROW_COST}


# ---------------------------------------------------------------- proposer, acceptance, options
def test_ngram_proposes_what_followed_the_longest_latest_match():
    p = NgramProposer(3, max_n=3, min_n=1)
    # suffix [7, 8] occurred at 1..2 (followed by 9, 10, 11) and at 5..6 (followed by 1, 7, 8): latest wins
    assert p.propose([5, 7, 8, 9, 10, 11, 7, 8, 1, 7, 8]) == [1, 7, 8]
    # the longest suffix that matches wins over a later shorter one: [2, 3] matched at 0..1
    assert p.propose([2, 3, 4, 5, 6, 9, 3, 7, 2, 3]) == [4, 5, 6]
    assert p.propose([1, 2, 3, 4]) == []  # no earlier occurrence of any suffix
    assert p.propose([1, 2, 1, 2], max_tokens=1) == [1]
    assert p.propose([1, 2, 1, 2], max_tokens=0) == []
    # a run: the latest match is followed by one token only, the earliest by the most
    assert p.propose([4, 4, 4, 4]) == [4]
    assert NgramProposer(2, max_n=1).propose([5, 4, 4, 4, 4, 4]) == [4, 4]
    assert NgramProposer(4, max_n=2, min_n=2).propose([1, 2, 3, 9, 2, 3]) == [9, 2, 3]


def lookup_by_definition(token_ids, k, max_n, min_n):
    """The proposer's rule, written the slow way: for n = max_n..min_n, every earlier place the n-token
    suffix occurs; the latest followed by k tokens, else the earliest."""
    size = len(token_ids)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        starts = [s for s in range(size - n) if token_ids[s:s + n] == token_ids[size - n:]]
        if starts:
            full = [s for s in starts if s + n + k <= size]
            s = full[-1] if full else starts[0]
            return token_ids[s + n:s + n + k]
    return []


def test_ngram_proposer_matches_its_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(1, 30))]
        k, max_n = rng.randint(1, 5), rng.randint(1, 4)
        min_n = rng.randint(1, max_n)
        assert NgramProposer(k, max_n, min_n).propose(ids) == lookup_by_definition(ids, k, max_n, min_n), \
            (ids, k, max_n, min_n)


def test_accepted_tokens_is_the_longest_equal_prefix_plus_the_models_token():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + the bonus token
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the model's token replaces the first miss
    assert accepted_tokens([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accepted_tokens([], [3]) == [3]


@pytest.mark.parametrize("bad, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'draft_model' needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "tiny-qwen3"}, r"\['model'\] do not apply"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny-qwen3", "prompt_lookup_max": 2},
     "do not apply to method 'draft_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny-qwen3", "quantization": "fp4"},
     "quantization must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "must be <= 16"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown speculative_config key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min=3 is above"),
    ({"method": "ngram", "num_speculative_tokens": 2, "row_cost": 1.5}, r"row_cost must be \"measured\" or"),
    ({"method": "ngram", "num_speculative_tokens": 2, "row_cost": "auto"}, "number in \\[0, 1\\)"),
    ("{not json", "not valid JSON"),
])
def test_speculative_config_errors_name_the_problem(bad, message):
    with pytest.raises(InvalidValueError, match=message):
        EngineConfig(speculative_config=bad)


def test_speculative_config_accepts_json_and_refuses_overlap():
    spec = EngineConfig(speculative_config=json.dumps(NGRAM)).speculative_config  # as the command line has it
    assert spec == SpeculativeConfig("ngram", 4) and spec.row_cost == "measured"
    fixed = EngineConfig(speculative_config=json.dumps(FIXED_NGRAM)).speculative_config
    assert fixed.row_cost == VERIFY_ROW_COST
    with pytest.raises(InvalidValueError, match="does not overlap steps"):
        EngineConfig(speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(InvalidValueError, match="trace=True with speculative_config is not supported yet"):
        EngineConfig(speculative_config=NGRAM, trace=True)


# ---------------------------------------------------------------- how many drafts (policy.py)
def test_best_k_is_the_argmax_of_tokens_per_cost():
    """Against the cost model computed the slow way: the expected tokens of k drafts as the sum over the
    number kept (j drafts kept, then a miss, or all k kept) over 1 + c·k."""
    def rate(a, k, c):
        tokens = sum((j + 1) * a ** j * (1 - a) for j in range(k)) + (k + 1) * a ** k
        return tokens / (1 + c * k)

    for a in [0.0, 0.05, 0.2, 0.3, 0.5, 0.7, 0.85, 0.95, 0.99]:
        for c in [0.1, 0.22, 0.5]:
            for max_k in [1, 4, 8]:
                rates = [rate(a, k, c) for k in range(max_k + 1)]
                want = max(range(max_k + 1), key=lambda k: (round(rates[k], 9), -k))
                assert best_k(a, max_k, c) == want, (a, c, max_k, rates)
    assert best_k(0.0, 4) == 0 and best_k(0.99, 4) == 4


def test_step_cost_fits_the_steps_and_prices_a_row_by_the_batch():
    """StepCost: the prior until steps of two row counts are seen; then T0 and r of seconds = T0 + r * rows
    (noisy steps, against numpy's least squares over the same steps), and c = r * B / (T0 + r * B)."""
    import numpy as np

    cost = StepCost(prior=0.2)
    assert cost.row_cost(1) == pytest.approx(0.2) and cost.row_cost(32) > 0.85  # (r / T0 = 0.25)
    for _ in range(10):
        cost.observe(1, 0.010)
    assert cost.fit() is None and cost.row_cost(1) == pytest.approx(0.2)  # one row count: no fit
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 6, size=200)
    secs = 0.010 + 0.002 * rows + rng.normal(0, 1e-4, size=200)
    cost = StepCost()
    for r, t in zip(rows, secs):
        cost.observe(int(r), float(t))
    t0, r = cost.fit()
    assert t0 == pytest.approx(0.010, rel=0.05) and r == pytest.approx(0.002, rel=0.05)
    want_r, want_t0 = np.polyfit(rows[-60:], secs[-60:], 1)  # the decay weighs the last steps most
    assert r == pytest.approx(want_r, rel=0.1) and t0 == pytest.approx(want_t0, rel=0.1)
    assert cost.row_cost(1) == pytest.approx(r / (t0 + r))
    assert cost.row_cost(32) == pytest.approx(32 * r / (t0 + 32 * r))
    policy = AdaptiveK(4)  # a cheap row drafts more than a dear one, at the same acceptance
    assert policy.choose(1, cost=0.05) > policy.choose(2, cost=0.9)
    fixed = StepCost(prior=0.2, measure=False)  # speculative_config row_cost: the steps change nothing
    for r, t in zip(rows, secs):
        fixed.observe(int(r), float(t))
    assert fixed.fit() is None and fixed.row_cost(1) == pytest.approx(0.2)


def test_a_sequence_whose_drafts_are_rejected_stops_drafting_and_is_probed_again():
    policy = AdaptiveK(4)
    first = policy.choose(1)
    assert first > 0  # a new sequence drafts
    ks = []
    for _ in range(300):  # every draft rejected
        k = policy.choose(1)
        ks.append(k)
        policy.observe(1, k, 0)
    assert ks[:2] != [0, 0] and ks[-50:].count(0) >= 48  # it stops drafting ...
    probes = [i for i, k in enumerate(ks) if k and i > 10]
    assert probes and all(ks[i] == 1 for i in probes)  # ... but for one-draft probes,
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] > PROBE_INTERVAL and gaps == sorted(gaps) and gaps[-1] == MAX_PROBE_INTERVAL + 1  # sparser
    for _ in range(2 * MAX_PROBE_INTERVAL):  # it starts copying: the next probe is accepted, and k climbs
        k = policy.choose(1)
        policy.observe(1, k, k)
    assert policy.choose(1) == 4
    policy.forget(1)
    assert policy.states == {}


class AlwaysWrong:
    """Proposes k tokens the stub model never prefers (it cannot produce STUB_V + 1)."""

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        return [STUB_V + 1] * min(4, max_tokens)


# ---------------------------------------------------------------- rejection sampling
CHI2_DF5_P001 = CHI2_P001[5]  # the chi-square critical value for 5 degrees of freedom at p = 0.001


@pytest.mark.parametrize("draft", ["distribution", "point_mass", "same_as_target"])
def test_rejection_sampling_gives_the_target_distribution(draft):
    g = torch.Generator().manual_seed(0)
    V, N = 6, 200_000
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=0)
    q = {"distribution": torch.softmax(torch.randn(V, generator=g) * 1.5, dim=0),
         "point_mass": torch.nn.functional.one_hot(torch.tensor(2), V).float(), "same_as_target": p}[draft]
    drafts = torch.multinomial(q, N, replacement=True, generator=g)  # [N] drawn from q
    out = rejection_sample(p.expand(N, V), q.expand(N, V), drafts, generator=g)  # [N]
    assert chi_square(out, p) < CHI2_DF5_P001, (torch.bincount(out, minlength=V) / N, p)
    accepted = (out == drafts).double().mean().item()
    assert abs(accepted - torch.minimum(p, q).sum().item()) < 0.01  # P(accept) = sum min(p, q)
    # the bonus position (no draft) draws from p too, and a seed reproduces the draws
    bonus = rejection_sample(p.expand(N, V), q.expand(N, V), torch.full((N,), -1), generator=g)
    assert chi_square(bonus, p) < CHI2_DF5_P001
    again = [rejection_sample(p.expand(64, V), q.expand(64, V), drafts[:64],
                              generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(again[0], again[1])


def test_point_mass_rejection_sampling_is_sample_then_compare():
    """For a deterministic proposer (n-gram) the rule reduces to: draw t ~ p, accept the draft iff t == d.
    Both give the same joint law of (accepted?, token): checked on the counts of each outcome."""
    g = torch.Generator().manual_seed(1)
    V, N, d = 6, 200_000, 3
    p = torch.softmax(torch.randn(V, generator=g), dim=0)
    q = torch.nn.functional.one_hot(torch.tensor(d), V).float()
    rule = rejection_sample(p.expand(N, V), q.expand(N, V), torch.full((N,), d), generator=g)
    plain = torch.multinomial(p, N, replacement=True, generator=g)
    assert chi_square(rule, p) < CHI2_DF5_P001 and chi_square(plain, p) < CHI2_DF5_P001
    assert abs((rule == d).double().mean().item() - p[d].item()) < 0.005


# ---------------------------------------------------------------- exactness over a fake KV cache
STUB_V = 16  # the stub's next tokens come from 0..15 (single characters), so n-grams repeat


def next_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """The stub model: logits [STUB_V] that depend on the whole prefix, with a strong preference for a token
    that follows from the last two (so the n-gram proposer is often, not always, right)."""
    g = torch.Generator().manual_seed(hash(prefix) % (1 << 31))
    logits = torch.randn(STUB_V, generator=g)
    logits[(7 * prefix[-1] + (prefix[-2] if len(prefix) > 1 else 0)) % STUB_V] += 2.5
    return logits


class FakeKVExecutor(StubExecutor):
    """Every cache slot holds the token prefix its K/V were computed for; each row's prefix is the one in the
    slot before it (through the row's block table) plus its token; a sampled row's logits are
    next_logits(prefix)."""

    def __init__(self, plan, parts, num_blocks, seed=0):
        super().__init__(plan, parts, num_blocks, seed)
        self.block_size = plan.block_size
        self.kv: dict[int, tuple[int, ...]] = {}
        self.recomputed = 0  # K/V written again for the prefix their slot held already

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run_step(self, inp: ModelInput, prev_tokens):
        meta = inp.attn
        ids, positions, slots = inp.input_ids.tolist(), inp.positions.tolist(), meta.slot_mapping.tolist()
        tables = [meta.decode_block_tables[r].tolist() for r in range(meta.num_decode_seqs)]
        for n, table in zip(meta.prefill_query_lens, meta.prefill_block_tables):
            tables += [table.tolist()] * n
        prefixes = []
        for token, pos, slot, table in zip(ids, positions, slots, tables):
            before = self.kv[self.slot(table, pos - 1)] if pos else ()
            assert len(before) == pos, f"slot of position {pos - 1} holds a prefix of {len(before)} tokens"
            prefixes.append(before + (token,))
            if slot >= 0:
                self.recomputed += self.kv.get(slot) == prefixes[-1]
                self.kv[slot] = prefixes[-1]
            else:  # a prefix-cache hit: the slot already holds exactly this
                assert self.kv[self.slot(table, pos)] == prefixes[-1]
        rows = inp.sample_rows.tolist()
        if not rows:
            return None
        logits = torch.full((len(rows), 64), -1e4)
        logits[:, :STUB_V] = torch.stack([next_logits(prefixes[r]) for r in rows])
        return logits

    def check_cached_blocks(self, bm: BlockManager) -> None:
        """Every block in the prefix cache holds the K/V of exactly its tokens: no rejected draft's."""
        for block_id in bm.hash_to_block_id.values():
            block = bm.blocks[block_id]
            for j, token in enumerate(block.token_ids):
                held = self.kv[block_id * self.block_size + j]
                assert held[-1] == token, f"cached block {block_id} slot {j} holds {held[-1]}, not {token}"


class NoisyOracle:
    """Proposes the answer (the no-speculation run's tokens) with some drafts changed, some shortened, and
    for some steps nothing: every acceptance length, and batches of speculating and plain sequences."""

    def __init__(self, answers: list[list[int]], k: int = 4, seed: int = 0) -> None:
        self.answers, self.k, self.rng = answers, k, random.Random(seed)

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        n = len(token_ids)
        for answer in self.answers:
            if answer[:n] == token_ids:
                drafts = answer[n:n + self.rng.randint(0, min(self.k, max_tokens))]
                return [t if self.rng.random() < 0.75 else self.rng.randrange(STUB_V) for t in drafts]
        return []


MAX_STEPS = 2000  # a run that takes longer is stuck


def run(eng, prompts, params, check=None) -> list[tuple]:
    reqs = [eng.make_request(p, sp) for p, sp in zip(prompts, params)]
    for r in reqs:
        eng.add(r)
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished():
            break
        eng.step()
        if check is not None:
            check(eng)
    else:
        raise AssertionError(f"the requests did not finish in {MAX_STEPS} steps")
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for r in reqs for c in r.output().outputs]


def stub(spec=None, num_blocks=64, **options):
    options = {"max_num_batched_tokens": 16, "block_size": 4, **options}
    return stub_engine("tiny-qwen3", False, num_blocks, executor=FakeKVExecutor, speculative_config=spec,
                       **options)


def checker(eng):
    bm = eng.block_manager
    bm.check_invariants(eng.scheduler.running)
    eng.executor.check_cached_blocks(bm)
    for seq in eng.scheduler.running:  # rolled back: no block past the known tokens' (rejected drafts')
        assert len(seq.block_table) <= bm.blocks_for(seq.num_tokens), seq


SHARED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
STUB_PROMPTS = [SHARED + [1], [7], SHARED + [2, 7, 1, 8, 2, 8], [4] * 20, SHARED + [3], [9, 8, 7, 6, 5] * 3]


def greedy_params(stop_text: str | None = None, stop_id: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=40, stop=[stop_text] if stop_text else None),
            SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id] if stop_id else None,
                           ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=25, n=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)]


@pytest.mark.parametrize("pool", [64, 16])  # 16 blocks of 4 tokens: preemption
def test_greedy_speculation_is_exact_over_a_fake_kv_cache(pool):
    plain = run(stub(num_blocks=200), STUB_PROMPTS, greedy_params())
    stop_text, stop_id = plain[2][1][9:11], plain[3][0][12]  # a stop string and a stop id the runs reach
    params = greedy_params(stop_text, stop_id)
    want = run(stub(num_blocks=200), STUB_PROMPTS, params)
    assert want[2][2:] == ("stop", stop_text) and want[3][2:] == ("stop", stop_id)
    answers = [list(p) + w[0] for p, w in zip([q for q, sp in zip(STUB_PROMPTS, params) for _ in range(sp.n)],
                                              want)]
    for proposer in ["ngram", NoisyOracle(answers)]:
        eng = stub(FIXED_NGRAM, num_blocks=pool)
        if proposer != "ngram":
            eng.drafts.proposer = proposer
        assert run(eng, STUB_PROMPTS, params, checker) == want, proposer
        counts = eng.spec_counts
        assert 0 < counts.accepted < counts.proposed  # both kinds of verification happened
        if pool == 16:
            assert any(s.num_preemptions for r in eng.requests.values() for s in r.seqs)
        else:  # an accepted draft's K/V is kept, never computed again
            assert eng.executor.recomputed == 0
        assert eng.block_manager.num_free_blocks == pool  # everything given back


def test_adaptive_drafts_stay_exact_stop_when_rejected_and_are_forgotten_at_the_end():
    """Drafts that are always rejected: the sequences soon decode plainly (probes aside), the output is the
    plain one, and the policy forgets every sequence that finished or was aborted."""
    params = greedy_params()
    want = run(stub(num_blocks=200), STUB_PROMPTS, params)
    eng = stub(FIXED_NGRAM, num_blocks=200)
    eng.drafts.proposer = AlwaysWrong()
    assert run(eng, STUB_PROMPTS, params, checker) == want
    counts, decodes = eng.spec_counts, sum(len(w[0]) - 1 for w in want)
    assert counts.accepted == 0 and counts.verifications < decodes // 4, (counts, decodes)
    assert eng.drafts.policy.states == {}
    fixed = stub(NGRAM, num_blocks=200)  # without the policy: a verification per decode
    fixed.drafts.proposer, fixed.drafts.policy = AlwaysWrong(), None
    assert run(fixed, STUB_PROMPTS, params) == want
    assert fixed.spec_counts.verifications > 3 * counts.verifications
    req = eng.make_request(SHARED, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.add(req)
    for _ in range(4):
        eng.step()
    assert eng.drafts.policy.states  # it has a state while it runs ...
    eng.abort(req.request_id)
    assert eng.drafts.policy.states == {}  # ... and none once aborted


def test_prefix_hits_and_rollback_keep_the_cache_clean():
    """A prompt whose blocks another request's verified output filled hits them, and the rejected drafts'
    blocks are back in the free list unhashed."""
    eng = stub(FIXED_NGRAM, num_blocks=64)
    first = run(eng, [SHARED], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)], checker)
    again = SHARED + first[0][0][:8]  # its prompt + 8 generated tokens: two more full blocks
    out = run(eng, [again], [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)], checker)
    req = list(eng.requests.values())[-1]
    assert req.output().num_cached_tokens == 16  # 4 full blocks of 4: 2 of the prompt, 2 of the output
    plain = stub(num_blocks=64)
    assert run(plain, [again], [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]) == out
    assert eng.block_manager.num_free_blocks == 64


def test_seeded_sampling_with_speculation_is_reproducible():
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=20, ignore_eos=True)]
    runs = [run(stub(NGRAM), STUB_PROMPTS[:2], params, checker) for _ in range(2)]
    assert runs[0] == runs[1]


class StubPreference:
    """Proposes the token the stub model prefers after the last two, chained (a deterministic proposer, as
    n-gram: right about half the time at temperature 1)."""

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        ids = list(token_ids)
        for _ in range(min(3, max_tokens)):
            ids.append((7 * ids[-1] + ids[-2]) % STUB_V)
        return ids[len(token_ids):]


CHI2_DF15_P001 = CHI2_P001[15]


def test_sampled_speculation_follows_the_models_distribution():
    """The 2nd and 3rd sampled tokens of many seeded requests (positions drafts decide) against their exact
    marginal laws under the stub model, by chi-square on its 16 tokens."""
    prompt, n = [1, 2], 1500
    eng = stub(NGRAM, num_blocks=2048, max_num_batched_tokens=4096, max_num_seqs=256)
    # drafts at every step (no policy: at 256 sequences a step, it would judge drafting too dear)
    eng.drafts.proposer, eng.drafts.policy = StubPreference(), None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    out = run(eng, [prompt] * n, params)
    assert eng.spec_counts.accepted > n // 4 and eng.spec_counts.accepted < eng.spec_counts.proposed

    def probs(prefix):
        return torch.softmax(next_logits(tuple(prefix)), dim=0)

    p1 = probs(prompt)
    p2 = sum(p1[a] * probs(prompt + [a]) for a in range(STUB_V))
    p3 = sum(p1[a] * probs(prompt + [a])[b] * probs(prompt + [a, b])
             for a in range(STUB_V) for b in range(STUB_V))
    for i, law in [(1, p2), (2, p3)]:
        tokens = torch.tensor([o[0][i] for o in out])
        assert chi_square(tokens, law) < CHI2_DF15_P001, i


# ---------------------------------------------------------------- the real model
def test_tiny_qwen3_greedy_speculation_equals_plain():
    kw = dict(dtype="float32", max_num_batched_tokens=32, num_kvcache_blocks=10, block_size=16)
    prompts = ["The paged KV cache stores keys and values in fixed-size blocks, so that one", "Hi",
               "The paged KV cache stores keys and values in fixed-size blocks, and two", "x " * 30]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM("tiny-qwen3", **kw)
    outs = plain.generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in outs]
    spec = LLM("tiny-qwen3", speculative_config=NGRAM, **kw)
    answers = [o.prompt_token_ids + w for o, w in zip(outs, want)]
    spec.engine.drafts.proposer = NoisyOracle(answers, k=4, seed=1)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    counts = spec.engine.spec_counts
    assert 0 < counts.accepted < counts.proposed
    assert spec.engine.step_count < plain.engine.step_count


def noisy_copy(folder, scale: float, seed: int = 1):
    """tiny-qwen3 with Gaussian noise of `scale` times each tensor's std on every weight: a draft model that
    shares its tokenizer and agrees with it on most tokens, not all."""
    import shutil

    from safetensors.torch import load_file, save_file

    from nanoengine import assets

    src = assets.ensure("tiny-qwen3")
    shutil.copytree(src, folder, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weights = load_file(src / "model.safetensors")
    save_file({k: v + scale * v.std() * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_draft_model_that_disagrees_sometimes_gives_the_targets_tokens(tmp_path):
    """Greedy: token-identical to no speculation through chunked prefill (32-token budget), preemption (10
    blocks), prefix hits (shared prompts) and n=2; seeded sampling reproducible; both pools given back."""
    draft = {"method": "draft_model", "model": str(noisy_copy(tmp_path / "draft", 0.5)),
             "num_speculative_tokens": 3}
    kw = dict(dtype="float32", max_num_batched_tokens=32, num_kvcache_blocks=10, block_size=16)
    prompts = ["The paged KV cache stores keys and values in fixed-size blocks, so that one", "Hi",
               "The paged KV cache stores keys and values in fixed-size blocks, and two", "x " * 30]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0, max_tokens=16, n=2, ignore_eos=True)]
    plain = LLM("tiny-qwen3", **kw)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM("tiny-qwen3", speculative_config=draft, **kw)
    proposer, batches = spec.engine.drafts.proposer, []
    propose_many = proposer.propose_many

    def recorded(token_ids, max_tokens):
        batches.append(sum(m > 0 for m in max_tokens))
        return propose_many(token_ids, max_tokens)

    proposer.propose_many = recorded
    got = [[c.token_ids for c in o.outputs] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert max(batches) > 1, batches  # one draft run serves several sequences
    assert spec.engine.drafts.policy.states == {}
    counts, eng = spec.engine.spec_counts, spec.engine
    assert 0 < counts.accepted < counts.proposed, counts  # drafts kept and drafts rejected
    assert any(st.num_preempted for st in eng.stats), "the 10-block pool should preempt"
    assert any(st.cache_hit_tokens for st in eng.stats), "the shared prompts should hit the prefix cache"
    assert eng.block_manager.num_free_blocks == 10
    assert eng.drafts.proposer.engine.block_manager.num_free_blocks == 10  # the draft's pool too
    sampled = [SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)] * 2
    runs = [[o.outputs[0].token_ids for o in spec.generate(prompts[:2], sampled, use_tqdm=False)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    spec.engine.close()


def test_a_draft_model_with_another_tokenizer_or_the_learners_ngram_pieces_is_refused():
    with pytest.raises(InvalidValueError, match="plugs in your n-gram proposer"):
        LLM("tiny-qwen3", use_exercises=["ch09"], exercises_dir="solutions",
            speculative_config={"method": "draft_model", "model": "tiny-qwen3", "num_speculative_tokens": 2})
    with pytest.raises(InvalidValueError, match="a draft model must share the target's tokenizer"):
        LLM("tiny-qwen3", speculative_config={"method": "draft_model", "model": "smollm2-135m",
                                              "num_speculative_tokens": 2})


def test_the_learners_pieces_run_with_speculation_or_are_refused_clearly():
    """The learner's prefix cache (ch04) verifies drafts as the engine's does; their own scheduler pass (ch05)
    knows nothing of drafts, so that pair is refused instead of speculating never."""
    prompt = ["The cat sat on the mat. The cat sat on the mat. The cat"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = LLM("tiny-qwen3", dtype="float32").generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    mine = LLM("tiny-qwen3", dtype="float32", use_exercises=["ch04"], exercises_dir="solutions",
               speculative_config=NGRAM)
    assert mine.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert mine.engine.spec_counts.accepted > 0, "the repeated sentence should be drafted and accepted"
    with pytest.raises(InvalidValueError, match="speculative_config needs the engine's own scheduler"):
        LLM("tiny-qwen3", use_exercises=["ch05"], exercises_dir="solutions", speculative_config=NGRAM)


def test_spec_bench_writes_its_figures(tmp_path):
    from nanoengine.bench import spec as bench

    argv = ["--model", "tiny-qwen3", "--max-tokens", "8", "--repeats", "1", "--out-dir", str(tmp_path),
            "--draft-model", "tiny-qwen3", "--compare-fixed"]
    assert bench.main(argv) == 0
    result = json.loads(next(tmp_path.glob("spec_*.json")).read_text())
    assert result["speculative_configs"]["ngram"]["num_speculative_tokens"] == 4
    for task in ("grounded", "free"):
        t = result["tasks"][task]
        assert t["same_tokens"] and t["output_tokens"] == 8
        assert t["tokens_per_target_forward_ngram"] >= 1 == t["tokens_per_target_forward_plain"]
        assert t["decode_tok_s_plain"] > 0 and t["decode_tok_s_ngram"] > 0
        assert t["acceptance_rate_draft"] == 1  # the model as its own draft: every draft is its own token
        assert t["acceptance_rate_draft-fixed"] == 1
        assert t["decode_tok_s_ngram-fixed"] > 0
    assert result["adaptive"] == {"ngram": True, "draft": True, "ngram-fixed": False, "draft-fixed": False}
