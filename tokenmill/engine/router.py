"""Which data-parallel replica takes a request: the one that was sent the longest run of its prompt's first blocks
(SGLang's cache-aware policy), round-robin, or the least loaded. The router cannot see the replicas' caches: it
remembers the prompt blocks it sent to each (no more than that replica's cache holds, the least recently routed
dropped first), as SGLang's router keeps a tree of what it routed."""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from tokenmill.engine.async_engine import EngineDeadError

ROUTING = ("cache_aware", "round_robin", "least_loaded")
# a replica this many requests busier than the least loaded one gets no more requests for its cached prefixes
# (SGLang's balance_abs_threshold): a popular prefix must not pile every request onto one replica
BALANCE_ABS = 32


def check_routing(policy: str) -> None:
    if policy not in ROUTING:
        raise ValueError(f"unknown data-parallel routing {policy!r}; choose one of {', '.join(ROUTING)}")


def block_hashes(ids: list[int], block_size: int, cache_salt: Optional[str] = None) -> list[int]:
    """A hash per full block of the prompt, each covering every token before it (as the prefix cache's keys). A
    cache_salt joins the first block's key, as in the cache: routing by a prefix must not tell one salt's requests
    where another's went."""
    out, h = [], 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        key = (h, tuple(ids[start:start + block_size]))
        h = hash(key if start or cache_salt is None else key + (cache_salt,))
        out.append(h)
    return out


class Router:
    """Picks a replica for each request: cache_aware (the replica that was sent the longest run of this prompt's
    first blocks, unless it is BALANCE_ABS requests busier than the least loaded), round_robin, or least_loaded
    (fewest requests in flight; ties go round)."""

    def __init__(self, policy: str, size: int, block_size: int, blocks_per_replica: int):
        check_routing(policy)
        self.policy, self.size, self.block_size, self.capacity = policy, size, block_size, blocks_per_replica
        self.load = [0] * size                           # requests in flight on each replica
        self._sent: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(size)]
        self._next = 0

    def pick(self, ids: list[int], alive: list[bool], cache_salt: Optional[str] = None) -> int:
        order = [i % self.size for i in range(self._next, self._next + self.size) if alive[i % self.size]]
        if not order:
            raise EngineDeadError("every data-parallel replica has stopped")
        hashes = block_hashes(ids, self.block_size, cache_salt)
        least = min(order, key=lambda i: self.load[i])
        choice = order[0] if self.policy == "round_robin" else least
        if self.policy == "cache_aware":
            matched = {i: self._matched(i, hashes) for i in order}
            best = max(order, key=lambda i: (matched[i], -self.load[i]))
            if matched[best] and self.load[best] - self.load[least] < BALANCE_ABS:
                choice = best
        self._next = choice + 1
        self.load[choice] += 1
        sent = self._sent[choice]
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.capacity:
            sent.popitem(last=False)
        return choice

    def _matched(self, replica: int, hashes: list[int]) -> int:
        sent = self._sent[replica]
        return next((n for n, h in enumerate(hashes) if h not in sent), len(hashes))
