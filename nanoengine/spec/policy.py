"""How many drafts a sequence gets at a step: as many as pay, judged by its acceptance so far. Chapter 09.

A verification of 1 + k rows costs about 1 + c·k decode steps (`VERIFY_ROW_COST`, c: at one stream the weights
are read once per step whatever the rows, and each extra row costs its share of compute and attention). If
each draft is accepted with probability a once the drafts before it were (the per-draft acceptance), it gives
(1 - a^(k+1)) / (1 - a) tokens on average (`expected_tokens`: the kept drafts and the model's own token). So
the k worth drafting is the one in 0..num_speculative_tokens with the most tokens per unit of cost (`best_k`);
k = 0 is a plain decode, and for a = 0 nothing is worth drafting. A draft model's own decode steps are not
in the cost (the same rule serves both proposers; a draft model is chosen to be much cheaper than the
target, and one as big as it, as the tests use, would never draft).

`AdaptiveK` keeps, per sequence, a decayed count of accepted drafts and of rejections (a verification rejects
one draft, the first one the model disagrees with, or none): accepted / (accepted + rejections) estimates a
(the maximum-likelihood estimate for a geometric number of acceptances), and the decay
(`ACCEPTANCE_DECAY` per verification) lets it follow a sequence that starts or stops copying. A new sequence
starts from a prior (`PRIOR_ACCEPTED`, `PRIOR_REJECTED`). A sequence at k = 0 gives no evidence, so every
`PROBE_INTERVAL` plain steps it drafts one token again (a probe, at a cost of c); each probe that is rejected
doubles the interval (up to `MAX_PROBE_INTERVAL`), so free text pays a fraction of a percent for it, and one
that is accepted starts the sequence over from the prior (it speculates again, and its verifications say
for how long). The state of a sequence is dropped when it finishes (`forget`): the scheduler calls it from
every way a sequence ends (stop rules, stop strings, abort); a preempted sequence keeps it.

c itself is measured as the engine runs (`StepCost`): every decode-only step's forward time and rows fit
seconds = T0 + r * rows (decayed least squares), so the cost follows the machine, the dtype and the kernels
(at one stream on a 2-core AVX2 CPU, bf16 weight copies: c ~ 0.07; int8: ~0.25). With B sequences decoding
together a step costs each of them (T0 + r * B) / B, so one more row costs it c = r * B / (T0 + r * B): at
one stream little, at 32 streams (compute-bound) nearly a whole step, and drafting stops paying. Until the
steps have shown two different row counts, c is the prior `VERIFY_ROW_COST` (scaled the same way). Only
greedy sequences use the measured c: drafts change which draws a sampled sequence makes, and timings differ
from run to run, so a sampled sequence drafts by the prior and its tokens alone, and a seed reproduces it.
A greedy run's tokens never depend on c (verification is exact), but its schedule does: speculative_config's
`row_cost` fixes c (`measure=False`) where the schedule must be the same every run (the capstone, tests).

vLLM has no such option (its n-gram proposer drafts k whenever a suffix matches); here it is on by default and
`Speculator(policy=None)` turns it off (every decoding sequence asks for k drafts at every step: the benchmark
compares both).
"""

from __future__ import annotations

from dataclasses import dataclass

# c before the engine has measured it (`StepCost`): a verification of 1 + k rows of one sequence costs about
# (1 + c·k) plain decode steps at one stream. Measured on a 2-core AVX2 EPYC, SmolLM2-135M, with the
# small-batch kernels' register tiles: a step of 1 + 4 rows 1.26x a decode with bf16 weight
# copies (c = 0.065), 1.9x with int8 (c = 0.22); before them c was ~0.4. Too large a c gives up drafts that
# pay; too small, verifies drafts that do not.
VERIFY_ROW_COST = 0.15
STEP_COST_DECAY = 0.97  # per decode step: the fit follows the last ~30 steps most
MIN_ROW_SPREAD = 0.25  # the rows' (weighted) variance the fit needs before it replaces the prior
MIN_ROW_COST = 0.02  # the least c the fit gives (a row is never free: proposing, sampling, rolling back)
ACCEPTANCE_DECAY = 0.8  # per verification: the evidence of the last ~5 verifications weighs most
# a new sequence's estimate: a = 0.75, worth 2 verified drafts (with c = 0.4: 2 drafts, 3 then 4 as they are
# accepted; free text is down to k = 0 after 2 rejected verifications). Measured against a = 0.6 (1 draft
# first): 1.58x against 1.50x on the grounded task, the same on free text
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.5, 0.5
PROBE_INTERVAL = 8  # plain decode steps at k = 0 before a sequence drafts one token again
MAX_PROBE_INTERVAL = 64  # the interval doubles after each rejected probe, up to this


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verification of k drafts gives on average when each is accepted with probability a (once the
    ones before it were): 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(a: float, max_k: int, cost: float = VERIFY_ROW_COST) -> int:
    """The k in 0..max_k with the most expected tokens per unit of cost, expected_tokens(a, k) / (1 + cost·k);
    the smallest such k on a tie."""
    best, best_rate = 0, 1.0
    for k in range(1, max_k + 1):
        rate = expected_tokens(a, k) / (1.0 + cost * k)
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


class StepCost:
    """A decode step's seconds as T0 + r * rows, fit online by decayed least squares over the engine's
    decode-only steps (`observe`), and what one more row costs a sequence in units of its share of a step
    (`row_cost`, c in the module docstring)."""

    def __init__(self, prior: float = VERIFY_ROW_COST, measure: bool = True) -> None:
        self.prior = prior  # c at one stream until the fit can say (always, when not measuring)
        self.measure = measure  # False: `observe` ignores the steps (speculative_config row_cost fixed)
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0  # decayed weight and sums

    def observe(self, rows: int, seconds: float) -> None:
        if not self.measure:
            return
        d = STEP_COST_DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(T0, r) seconds, or None while the steps seen do not tell them apart (one row count)."""
        if self.n < 3:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var < MIN_ROW_SPREAD:
            return None
        r = max((self.sxy / self.n - mx * my) / var, 0.0)
        return max(my - r * mx, 1e-9), r

    def row_cost(self, batch: int) -> float:
        """c for a sequence decoding among `batch`: r * B / (T0 + r * B), from the fit, else the prior (whose
        r / T0 is c / (1 - c) at one stream)."""
        fitted = self.fit()
        if fitted is None:
            return self.prior_cost(batch)
        t0, r = fitted
        return max(r * batch / (t0 + r * batch), MIN_ROW_COST)

    def prior_cost(self, batch: int) -> float:
        """c from the prior alone: r / T0 = prior / (1 - prior), the same for every run."""
        ratio = self.prior / (1.0 - self.prior)
        return ratio * batch / (1.0 + ratio * batch)


@dataclass(slots=True)
class SeqAcceptance:
    """One sequence's evidence: decayed counts of accepted drafts and of rejections, plain steps since it last
    drafted, and its probe interval."""
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    idle: int = 0
    interval: int = PROBE_INTERVAL
    probing: bool = False

    @property
    def rate(self) -> float:
        """The per-draft acceptance estimate."""
        return self.accepted / (self.accepted + self.rejected)


class AdaptiveK:
    """Per sequence: the drafts to ask for at this step (`choose`), from its verifications (`observe`)."""

    def __init__(self, max_k: int, cost: float = VERIFY_ROW_COST, measure: bool = True) -> None:
        self.max_k = max_k
        self.cost = cost  # c when `choose` is given none
        self.step_cost = StepCost(cost, measure)  # c as measured (the Speculator asks it per step)
        self._best = {}  # memo of best_k by rounded rate and cost
        self.states: dict[int, SeqAcceptance] = {}

    def choose(self, seq_id: int, cost: float | None = None) -> int:
        """Drafts for seq_id's next step: best_k of its estimate at cost c (`cost`, else the constructor's),
        or a probe of one draft after `interval` plain steps."""
        state = self.states.get(seq_id)
        if state is None:
            state = self.states[seq_id] = SeqAcceptance()
        key = (round(state.rate, 3), round(self.cost if cost is None else cost, 2))
        k = self._best.get(key)
        if k is None:
            k = self._best[key] = best_k(key[0], self.max_k, key[1])
        if k > 0:
            return k
        state.idle += 1
        if state.idle > state.interval:
            state.probing = True
            return 1
        return 0

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        """seq_id's verification of `proposed` drafts kept the first `accepted`."""
        state = self.states.get(seq_id)
        if state is None or proposed == 0:
            return
        state.accepted = ACCEPTANCE_DECAY * state.accepted + accepted
        state.rejected = ACCEPTANCE_DECAY * state.rejected + (accepted < proposed)
        state.idle = 0
        if state.probing:  # a rejected probe waits twice as long for the next one; an accepted one starts
            state.probing = False  # over from the prior (the sequence may have turned to copying)
            if accepted:
                self.states[seq_id] = SeqAcceptance()
            else:
                state.interval = min(2 * state.interval, MAX_PROBE_INTERVAL)

    def forget(self, seq_id: int) -> None:
        """seq_id finished: drop its state."""
        self.states.pop(seq_id, None)
