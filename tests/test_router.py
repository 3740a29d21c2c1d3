"""The data-parallel router (serve/router.py): prefix affinity by the block manager's own hashes, the
in-flight bound, least-loaded and round-robin picks, replicas going down. Plain Python, milliseconds."""

import random

import pytest

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.sequence import Sequence
from nanoengine.errors import InvalidValueError
from nanoengine.sampling_params import SamplingParams
from nanoengine.serve.router import NoReplicaError, Router, prompt_block_hashes

BS = 4


def hashes(tokens, bs=BS):
    return prompt_block_hashes(list(tokens), bs)


def test_block_hashes_are_the_names_the_block_manager_caches_the_prompt_under():
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(4 * 7 + 3)]  # 7 full blocks and 3 tokens
    bm = BlockManager(16, BS)
    seq = Sequence(tokens, SamplingParams(max_tokens=1), BS)
    bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    cached = [bm.blocks[b].hash for b in seq.block_table]
    assert hashes(tokens) == cached[:7] and cached[7] is None
    assert hashes(tokens[:3]) == []  # no full block: nothing to match


def test_a_shared_prefix_sticks_to_the_replica_that_served_it_first():
    r = Router(3)
    system_a, system_b = list(range(100, 140)), list(range(200, 240))  # 10 blocks each
    first_a = r.choose(hashes(system_a + [1, 2, 3, 4, 5]))
    first_b = r.choose(hashes(system_b + [1]))
    assert (first_a.reason, first_b.reason) == ("least_loaded", "least_loaded")
    assert first_a.replica != first_b.replica  # idle replicas: a new prefix goes to the next one
    for q in range(20):
        a = r.choose(hashes(system_a + [q] * (q % 9)))
        b = r.choose(hashes(system_b + [q, q + 1]))
        assert (a.replica, a.reason) == (first_a.replica, "affinity")
        assert (b.replica, b.reason) == (first_b.replica, "affinity")


def test_the_longest_matching_prefix_wins():
    r = Router(2)
    base = list(range(16))  # 4 blocks
    r.start(r.choose(hashes(base)).replica)  # replica 0 serves the 4-block prefix (and stays busy)
    longer = r.choose(hashes(base + list(range(50, 58))))  # matches 4 blocks on 0: affinity
    assert (longer.replica, longer.reason) == (0, "affinity")
    r.table[hashes(base + list(range(50, 58)))[-1]] = 1  # say replica 1 served the 6-block prefix since
    assert r.choose(hashes(base + [7, 7, 7, 7])).replica == 0  # diverges after block 4: 0 holds the prefix
    assert r.choose(hashes(base + list(range(50, 60)))).replica == 1  # 6 blocks on 1 beat 4 on 0
    assert r.choose(hashes(base + [8, 8, 8, 8])).replica == 1  # 1 served the 4 blocks last


def test_past_the_bound_the_least_loaded_replica_takes_the_prefix():
    r = Router(2, max_in_flight=2)
    prompt = hashes(range(40))
    owner = r.choose(prompt).replica
    r.start(owner)
    c = r.choose(prompt)
    assert (c.replica, c.reason) == (owner, "affinity")
    r.start(owner)  # now 2 in flight: at the bound
    spill = r.choose(prompt)
    assert (spill.replica, spill.reason) == (1 - owner, "over_bound")
    assert r.choose(prompt).replica == 1 - owner  # the prefix's replica is now the one that served it last
    r.finish(owner)
    r.finish(owner)
    assert r.in_flight == [0, 0]


def test_least_loaded_takes_the_fewest_in_flight_and_round_robin_ignores_prompts():
    r = Router(3)
    for i, n in enumerate([3, 1, 2]):
        for _ in range(n):
            r.start(i)
    assert r.choose([]).replica == 1 and r.choose(hashes(range(8))).reason == "least_loaded"
    rr = Router(3, policy="round_robin")
    prompt = hashes(range(40))
    picks = [rr.choose(prompt) for _ in range(6)]
    assert [c.replica for c in picks] == [0, 1, 2, 0, 1, 2] and {c.reason for c in picks} == {"round_robin"}
    rr.mark_down(1)
    assert [rr.choose(prompt).replica for _ in range(4)] == [0, 2, 0, 2]


def test_a_replica_marked_down_gets_nothing_and_its_prefixes_move():
    r = Router(2)
    prompt = hashes(range(40))
    owner = r.choose(prompt).replica
    r.mark_down(owner)
    assert all(v != owner for v in r.table.values()) and r.num_up == 1
    moved = r.choose(prompt)
    assert (moved.replica, moved.reason) == (1 - owner, "least_loaded")
    assert r.choose(prompt).reason == "affinity"
    r.mark_down(1 - owner)
    with pytest.raises(NoReplicaError):
        r.choose(prompt)


def test_the_table_forgets_the_least_recently_used_hashes():
    r = Router(2, table_size=12)
    a, b = hashes(range(40)), hashes(range(1000, 1040))  # 10 blocks each
    r.choose(a)
    r.choose(b)
    assert len(r.table) == 12 and set(b) <= set(r.table) and not set(a[:8]) & set(r.table)


@pytest.mark.parametrize("kwargs, what", [({"num_replicas": 0}, "num_replicas"),
                                          ({"num_replicas": 2, "max_in_flight": 0}, "max_in_flight"),
                                          ({"num_replicas": 2, "policy": "random"}, "policy"),
                                          ({"num_replicas": True}, "num_replicas")])
def test_bad_settings_are_named(kwargs, what):
    with pytest.raises(InvalidValueError, match=what):
        Router(**kwargs)
