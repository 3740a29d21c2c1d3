"""The data-parallel router: which engine replica a request goes to. Chapter 07 (beyond one machine).

Plain Python over token ids, no model and no sockets, so it is testable in milliseconds. The front end
(`data_parallel.py`) tokenizes the prompt, hashes its full blocks with the block manager's chained hash
(`prompt_block_hashes`) and asks `Router.choose`:

- `cache_aware` (the default): the replica that last served the longest matching prefix of those hashes (a
  chained hash names the whole prefix up to its block, so the last hash found is the longest match), unless
  it already has `max_in_flight` requests in flight: then the least loaded replica ("over_bound"). No
  matching prefix: the least loaded replica ("least_loaded"). Every hash of the prompt then points at the
  chosen replica in an LRU table of at most `table_size` hashes (the replica's prefix cache is LRU too).
- `round_robin`: the next replica that is up, in turn, whatever the prompt.

Least loaded = the fewest requests in flight; ties go to the replica after the last one picked that way, so
new prefixes spread over idle replicas. A replica marked down gets no more requests, and its table entries
are dropped. The caller reports each request's start and finish (`start`, `finish`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from nanoengine.engine.block_manager import BlockManager
from nanoengine.errors import InvalidValueError

POLICIES = ("cache_aware", "round_robin")
REASONS = ("affinity", "over_bound", "least_loaded", "round_robin")  # why a request went where it went
DEFAULT_TABLE_SIZE = 1 << 16  # block hashes remembered (a 16-token block each: a million prompt tokens)


class NoReplicaError(RuntimeError):
    """Every replica is down."""


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, as the replica's block manager names them."""
    full = len(token_ids) // block_size * block_size
    return BlockManager.hash_blocks(token_ids[i:i + block_size] for i in range(0, full, block_size))


@dataclass(frozen=True)
class Choice:
    replica: int
    reason: str  # one of REASONS


class Router:
    def __init__(self, num_replicas: int, policy: str = "cache_aware", max_in_flight: int = 256,
                 table_size: int = DEFAULT_TABLE_SIZE) -> None:
        """max_in_flight: requests in flight on a prefix's replica beyond which affinity gives way to the
        least loaded replica. table_size: block hashes remembered (least recently used forgotten first)."""
        for name, value in (("num_replicas", num_replicas), ("max_in_flight", max_in_flight),
                            ("table_size", table_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidValueError(f"Router: {name} must be an integer >= 1, got {value!r}")
        if policy not in POLICIES:
            raise InvalidValueError(f"Router: policy must be one of {POLICIES} (--router), got {policy!r}")
        self.policy, self.max_in_flight, self.table_size = policy, max_in_flight, table_size
        self.in_flight = [0] * num_replicas
        self.up = [True] * num_replicas
        self.table: OrderedDict[int, int] = OrderedDict()  # block hash -> the replica that served it last
        self._next = 0  # where the next round-robin pick or least-loaded tie-break starts

    @property
    def num_up(self) -> int:
        return sum(self.up)

    def choose(self, block_hashes: list[int]) -> Choice:
        """Where a prompt with these full-block hashes goes (see the module docstring); raises
        NoReplicaError when every replica is down. Records the prompt's hashes under the choice."""
        if not any(self.up):
            raise NoReplicaError("every replica is down")
        if self.policy == "round_robin":
            i = self._after(self._next, lambda j: self.up[j])
            self._next = (i + 1) % len(self.up)
            return Choice(i, "round_robin")
        owner = next((self.table[h] for h in reversed(block_hashes) if h in self.table), None)
        if owner is not None and self.in_flight[owner] < self.max_in_flight:
            choice = Choice(owner, "affinity")
        else:
            choice = Choice(self.least_loaded(), "least_loaded" if owner is None else "over_bound")
        for h in block_hashes:
            self.table[h] = choice.replica
            self.table.move_to_end(h)
        while len(self.table) > self.table_size:
            self.table.popitem(last=False)
        return choice

    def least_loaded(self) -> int:
        """The up replica with the fewest requests in flight; ties: the first after the last pick."""
        fewest = min(n for n, up in zip(self.in_flight, self.up) if up)
        i = self._after(self._next, lambda j: self.up[j] and self.in_flight[j] == fewest)
        self._next = (i + 1) % len(self.up)
        return i

    def _after(self, start: int, ok: Callable[[int], bool]) -> int:
        n = len(self.up)
        return next(j % n for j in range(start, start + n) if ok(j % n))

    def start(self, replica: int) -> None:
        self.in_flight[replica] += 1

    def finish(self, replica: int) -> None:
        self.in_flight[replica] -= 1

    def mark_down(self, replica: int) -> None:
        """The replica is gone: no more requests for it, and its prefixes are forgotten."""
        self.up[replica] = False
        for h in [h for h, r in self.table.items() if r == replica]:
            del self.table[h]
