"""The paged KV cache's bookkeeping: a block pool with ref counts, a free queue and a prefix-cache hash chain.

Plain Python over integers; the runner owns the tensors. Invariants (check_integrity):
free + in use == total; a block is in the free queue iff its ref count is 0; the prefix-cache map points only
at blocks that carry that hash; ref counts equal the number of requests holding each block.

A model whose layers attend differently (Gemma: global layers and sliding-window ones) keeps its layers in groups
of equal size, each group with a block table per request, all drawing blocks ("pages": a block of tokens for one
group's layers) from one pool (HybridKVCacheManager, vLLM's hybrid allocator): a sliding-window group gives its
blocks back as the window passes them, so its layers hold a window's worth of KV, not the whole context.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tokenmill.engine.request import Request

# finds a block below the pool: (group, block hash, block key) -> what loads it, or None
Finder = Callable[[int, int, tuple], Optional[Any]]

NO_BLOCK = -1   # a block-table entry whose block a sliding window freed
LOAD = -2       # in a prefix hit: a block an offload tier holds; a fresh block takes it, filled before the step


def block_digest(key: tuple) -> int:
    """A block's hash: 128 bits of blake2b over its key's text, the same in every process (Python's hash() of a
    string is salted per process, and the KV offload tiers keep blocks across restarts)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=16).digest(), "little")


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[int] = None
    key: Optional[tuple] = None           # (parent hash, token ids, extra keys): verified on a hit


class BlockPool:
    """The blocks, their free queue (least recently freed first) and the prefix-cache map (a group's block hash ->
    block id), shared by the managers of one cache's groups."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[tuple[int, int], int] = {}
        # cached blocks handed out for new tokens since the offload tier last took them: (block id, (group,
        # hash), key), read before the step overwrites them; None while no tier listens
        self.evicted: Optional[list[tuple[int, tuple[int, int], tuple]]] = None

    def cached_blocks(self) -> list[tuple[int, tuple[int, int], tuple]]:
        """The cached blocks as (block id, (group, hash), key)."""
        return [(b.block_id, b.block_hash, b.key) for b in self.blocks
                if b.block_hash is not None and self.cached.get(b.block_hash) == b.block_id]


class KVCacheManager:
    """One group's block tables (the whole cache's, for a model whose layers all attend alike). pool: the blocks
    it shares with other groups (its own by default); group: its hashes' namespace in the pool's prefix cache;
    cache_windowed: cache blocks under a sliding window too (a hybrid cache's window groups, whose hits
    HybridKVCacheManager finds)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: Optional[int] = None, pool: Optional[BlockPool] = None, group: int = 0,
                 cache_windowed: bool = False):
        self.pool = pool or BlockPool(num_blocks)
        self.num_blocks = self.pool.num_blocks
        self.block_size = block_size
        self.group = group
        # a sliding window frees blocks mid-sequence, which the hash chain alone cannot describe: no caching then,
        # unless the hybrid manager finds the window's blocks on a hit
        self.enable_caching = enable_caching and (sliding_window is None or cache_windowed)
        self.sliding_window = sliding_window
        self.blocks = self.pool.blocks
        self.free_queue = self.pool.free_queue
        self.cached = self.pool.cached                   # (group, block hash) -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}
        self.num_queries = 0                             # prefix-cache statistics, in tokens (as vLLM counts)
        self.num_hits = 0

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------------------
    def _block_key(self, req: Request, i: int, parent: Optional[int]) -> tuple:
        """Block i of req's key: (parent hash, its token ids, extra keys). The cache salt and the LoRA adapter are
        extra keys of the first block only (as in vLLM): every later block inherits them through its parent hash."""
        bs = self.block_size
        extra = None
        if i == 0 and (req.cache_salt is not None or req.lora is not None):     # an adapter's KV is its own
            extra = (req.cache_salt, req.lora_key)
        return (parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]), extra)

    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """The hash chain over req's first num_full_blocks full blocks, extended incrementally."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(block_digest(self._block_key(req, i, parent)))
        return hashes

    def block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """The hashes of req's first num_blocks full blocks."""
        return self._hashes(req, num_blocks)[:num_blocks]

    def block_keys(self, req: Request, first: int, last: int) -> list[tuple[int, tuple]]:
        """(hash, key) of req's full blocks first..last-1, for a lookup below the pool (the offload tiers)."""
        hashes = self._hashes(req, last)
        return [(hashes[i], self._block_key(req, i, hashes[i - 1] if i else None)) for i in range(first, last)]

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Cached blocks covering a prefix of req's tokens, and how many tokens they cover.

        Never covers the last token: its logits are needed to sample. None for a request that must compute every
        token (MEAN pooling: vLLM's skip_reading_prefix_cache); its blocks are still cached for others."""
        if not self.enable_caching or req.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._hashes(req, max_blocks)
        hit: list[int] = []
        bs = self.block_size
        for i in range(max_blocks):
            bid = self._cached_block(req, hashes, i)
            if bid is None:
                break
            hit.append(bid)
        self.num_queries += req.num_tokens
        self.num_hits += len(hit) * bs
        return hit, len(hit) * bs

    def extend_hit(self, req: Request, hit: list[int], find: Finder) -> tuple[list[int], list[tuple], int]:
        """hit (a prefix hit) extended past the pool's first miss: blocks that find(group, hash, key) finds below
        the pool, as LOAD entries, and blocks the pool still caches after them. Returns the hit, what each LOAD
        loads ((group, block index, what find gave)), and the tokens the hit covers."""
        last = (req.num_tokens - 1) // self.block_size
        hit, loads = list(hit), []
        if self.enable_caching and not req.skip_reading_prefix_cache:
            hashes = self._hashes(req, last)
            for i in range(len(hit), last):
                entry = self._entry(req, hashes, i, find, loads)
                if entry is None:
                    break
                hit.append(entry)
        return hit, loads, len(hit) * self.block_size

    def _entry(self, req: Request, hashes: list[int], i: int, find: Finder, loads: list) -> Optional[int]:
        """Block i of req below its pool hit: the pool's cached block, else LOAD (what loads it appended to
        loads), else None."""
        bid = self._cached_block(req, hashes, i)
        if bid is not None:
            return bid
        got = find(self.group, hashes[i], self._block_key(req, i, hashes[i - 1] if i else None))
        if got is None:
            return None
        loads.append((self.group, i, got))
        return LOAD

    def _cached_block(self, req: Request, hashes: list[int], i: int) -> Optional[int]:
        """The cached block holding req's block i, None on a miss (or a hash collision)."""
        bid = self.cached.get((self.group, hashes[i]))
        if bid is None:
            return None
        parent = hashes[i - 1] if i else None
        if self.blocks[bid].key != self._block_key(req, i, parent):
            return None
        return bid

    def window_hit(self, req: Request, num_blocks: int) -> Optional[list[int]]:
        """A sliding-window group's table for a hit on req's first num_blocks blocks: the blocks that the next
        query's window reaches, all cached, after NO_BLOCK for those it does not; None if one is missing."""
        hashes = self._hashes(req, num_blocks)
        first = max(0, num_blocks * self.block_size - self.sliding_window + 1) // self.block_size
        found = [self._cached_block(req, hashes, i) for i in range(first, num_blocks)]
        return None if None in found else [NO_BLOCK] * first + found

    # ---- allocation ----------------------------------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Whether allocate_slots would succeed now, counting the blocks a sliding window would free first."""
        need, freed = self.demand(req, num_new_tokens, computed_blocks)
        return need <= self.num_free_blocks + freed

    def demand(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> tuple[int, int]:
        """(blocks the pool must supply for num_new_tokens more tokens of req, blocks its window frees first)."""
        table = self.req_blocks.get(req.request_id, [])
        freed = 0
        if self.sliding_window is not None:      # only a block no other request shares goes back to the pool
            freed = sum(1 for b in table[:self._first_needed(req) // self.block_size]
                        if b != NO_BLOCK and self.blocks[b].ref_cnt == 1)
        return self._new_blocks(req, table, num_new_tokens, computed_blocks), freed

    def _new_blocks(self, req: Request, table: list[int], num_new_tokens: int, computed_blocks) -> int:
        """Blocks the pool must supply for num_new_tokens more tokens of req: its own new ones, and the hit blocks
        that sit in the free queue (a hit takes them out of it, so they can't be counted as free)."""
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(table) - len(computed_blocks)
        return need + sum(1 for b in computed_blocks if b == LOAD or (b >= 0 and self.blocks[b].ref_cnt == 0))

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for num_new_tokens more tokens of req (after computed_blocks, a prefix hit, on first call).

        Returns False, changing nothing, when the pool cannot supply the blocks."""
        self.free_passed(req)
        table = self.req_blocks[req.request_id]
        if self._new_blocks(req, table, num_new_tokens, computed_blocks) > self.num_free_blocks:
            return False
        self.take_hit(req, computed_blocks)
        self.fill_loads(req)
        self.grow(req, num_new_tokens, len(computed_blocks))
        return True

    def take_hit(self, req: Request, computed_blocks: list[int]) -> None:
        """Put a prefix hit's blocks in req's table (taking them out of the free queue): before any block is
        popped for new tokens or LOAD entries (fill_loads), which could evict one of them."""
        table = self.req_blocks.setdefault(req.request_id, [])
        for b in computed_blocks:
            table.append(b)
            if b < 0:                # NO_BLOCK (before a window group's hit: attended by no query), or LOAD
                continue
            blk = self.blocks[b]
            if blk.ref_cnt == 0:
                del self.free_queue[b]
            blk.ref_cnt += 1

    def fill_loads(self, req: Request) -> None:
        """A fresh block for each LOAD entry of req's table (after every hit is taken)."""
        table = self.req_blocks.get(req.request_id, [])
        for i, b in enumerate(table):
            if b == LOAD:
                table[i] = self._pop_free()

    def grow(self, req: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> None:
        """New blocks for num_new_tokens tokens of req past its computed ones and the hit just taken."""
        table = self.req_blocks.setdefault(req.request_id, [])
        total = req.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        for _ in range(max(self.blocks_needed(total) - len(table), 0)):
            table.append(self._pop_free())
        if self.enable_caching:     # speculative guesses are not tokens of the request yet: never cached
            self._cache_full_blocks(req, table, min(total, req.num_tokens))

    def trim(self, req: Request) -> None:
        """Return the blocks past req's computed tokens (those that only rejected guesses used)."""
        table = self.req_blocks.get(req.request_id, [])
        keep = self.blocks_needed(req.num_computed_tokens)
        while len(table) > keep:
            bid = table.pop()
            if bid != NO_BLOCK:
                self._release(bid)

    def _pop_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        blk = self.blocks[bid]
        if blk.block_hash is not None:              # evict: the least recently freed cached block goes first
            if self.cached.get(blk.block_hash) == bid:
                del self.cached[blk.block_hash]
                if self.pool.evicted is not None:
                    self.pool.evicted.append((bid, blk.block_hash, blk.key))
            blk.block_hash, blk.key = None, None
        blk.ref_cnt = 1
        return bid

    def _cache_full_blocks(self, req: Request, table: list[int], num_tokens: int) -> None:
        """Register the blocks that these tokens fill: they hold known tokens once this step's forward ran."""
        bs = self.block_size
        full = num_tokens // bs
        hashes = self._hashes(req, full)
        for i in range(full):
            if table[i] == NO_BLOCK:
                continue
            blk = self.blocks[table[i]]
            if blk.block_hash is not None:
                continue
            parent = hashes[i - 1] if i else None
            blk.block_hash = (self.group, hashes[i])
            blk.key = self._block_key(req, i, parent)
            self.cached.setdefault(blk.block_hash, blk.block_id)

    def free_passed(self, req: Request) -> None:
        """Give back blocks that no future query of req can attend under the sliding window (all positions <
        next_pos - window + 1); nothing without a window."""
        table = self.req_blocks.setdefault(req.request_id, [])
        if self.sliding_window is None:
            return
        for i in range(min(self._first_needed(req) // self.block_size, len(table))):
            if table[i] != NO_BLOCK:
                self._release(table[i])
                table[i] = NO_BLOCK

    def _first_needed(self, req: Request) -> int:
        """The first position a future query of req can attend under the sliding window."""
        return max(0, req.num_computed_tokens - self.sliding_window + 1)

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_cnt -= 1
        if blk.ref_cnt == 0:
            self.free_queue[bid] = None
            if blk.block_hash is None:                 # nothing worth keeping: reuse it first
                self.free_queue.move_to_end(bid, last=False)

    def free(self, req: Request) -> None:
        """Return all of req's blocks. Tail blocks go first so that a shared prefix outlives its suffixes."""
        for bid in reversed(self.req_blocks.pop(req.request_id, [])):
            if bid != NO_BLOCK:
                self._release(bid)
        self.req_hashes.pop(req.request_id, None)

    def reset_hashes(self, req: Request) -> None:
        self.req_hashes.pop(req.request_id, None)

    @property
    def full_group(self) -> int:
        """The group whose hits count a prefix's tokens (this one)."""
        return self.group

    def tables_of(self, request_id: str) -> list[list[int]]:
        """req's block table of each group (one here)."""
        return [self.blocks_of(request_id)]

    @property
    def num_groups(self) -> int:
        return 1

    # ---- invariants ----------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        _check_pool(self.pool, [self.req_blocks])


def _check_pool(pool: BlockPool, groups: list[dict[str, list[int]]]) -> None:
    """The invariants of a pool whose blocks the given groups' tables (request id -> table) hold."""
    refs = [0] * pool.num_blocks
    owner: dict[int, int] = {}
    for g, group in enumerate(groups):
        for table in group.values():
            for b in table:
                if b != NO_BLOCK:
                    refs[b] += 1
                    assert owner.setdefault(b, g) == g, f"block {b} is in the tables of groups {owner[b]} and {g}"
    in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    cached_free = sum(1 for b in pool.free_queue if pool.blocks[b].block_hash is not None)
    uncached_free = len(pool.free_queue) - cached_free
    assert uncached_free + cached_free + in_use == pool.num_blocks, "free + cached + in use != total"
    for b in pool.blocks:
        assert b.ref_cnt == refs[b.block_id], f"block {b.block_id}: ref {b.ref_cnt} != holders {refs[b.block_id]}"
        assert (b.ref_cnt == 0) == (b.block_id in pool.free_queue), f"block {b.block_id} free-queue mismatch"
    for h, bid in pool.cached.items():
        assert pool.blocks[bid].block_hash == h, f"cache map points at block {bid} without hash"


def make_kv_manager(num_blocks: int, block_size: int, enable_caching: bool,
                    windows: tuple[Optional[int], ...]) -> "KVCacheManager | HybridKVCacheManager":
    """The manager for a model's KV groups (layout.KVGroups.windows)."""
    if len(windows) == 1:
        return KVCacheManager(num_blocks, block_size, enable_caching, windows[0])
    return HybridKVCacheManager(num_blocks, block_size, enable_caching, list(windows))


def blocks_for(windows: tuple[Optional[int], ...], block_size: int, num_tokens: int) -> int:
    """Blocks of all groups that one request of num_tokens holds at most: a window group its window's and two
    more (the block being filled, and a prompt chunk's start)."""
    full = -(-num_tokens // block_size)
    return sum(full if w is None else min(full, -(-w // block_size) + 2) for w in windows)


class HybridKVCacheManager:
    """Groups of layers that attend differently (windows: each group's sliding window, None for full attention),
    each with its own block tables over one pool: the KVCacheManager interface the scheduler and engine use. A
    request's allocation succeeds in every group or in none. A prefix hit is the full-attention groups' hit,
    shortened until every window group still caches the blocks its window reaches there."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, windows: list[Optional[int]]):
        if sum(w is None for w in windows) > 1:
            raise ValueError("a hybrid KV cache has at most one full-attention group (layout.kv_groups makes one)")
        self.pool = BlockPool(num_blocks)
        # without a full-attention group there is no hash chain to hit on: no prefix caching then
        caching = enable_caching and None in windows
        self.groups = [KVCacheManager(num_blocks, block_size, caching, w, self.pool, g, cache_windowed=True)
                       for g, w in enumerate(windows)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = caching
        # the scheduler fits prompt chunks to the free blocks where a window bounds what a request holds
        self.sliding_window = max((w for w in windows if w is not None), default=None)
        self._full = next((g for g in self.groups if g.sliding_window is None), self.groups[0])

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def full_group(self) -> int:
        return self._full.group

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_queries(self) -> int:
        return self._full.num_queries

    @property
    def num_hits(self) -> int:
        return self._full.num_hits

    def blocks_of(self, request_id: str) -> list[int]:
        return self._full.blocks_of(request_id)

    def tables_of(self, request_id: str) -> list[list[int]]:
        return [g.blocks_of(request_id) for g in self.groups]

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(tuple(g.sliding_window for g in self.groups), self.block_size, num_tokens)

    def get_computed_blocks(self, req: Request) -> tuple[list[list[int]], int]:
        blocks, _ = self._full.get_computed_blocks(req)
        n = len(blocks)
        while n:
            tables = [blocks[:n] if g.sliding_window is None else g.window_hit(req, n) for g in self.groups]
            if all(t is not None for t in tables):
                break
            n -= 1
        self._full.num_hits -= (len(blocks) - n) * self.block_size
        if not n:
            return [], 0
        return tables, n * self.block_size

    def extend_hit(self, req: Request, hit: list[list[int]], find: Finder
                   ) -> tuple[list[list[int]], list[tuple], int]:
        """KVCacheManager.extend_hit for every group: the full-attention group's blocks past the hit (cached in the
        pool or below it), as far as each window group also has the blocks its window reaches there."""
        bs = self.block_size
        full = self.groups.index(self._full)
        n = len(hit[full]) if hit else 0
        last = (req.num_tokens - 1) // bs
        best: tuple[list[list[int]], list[tuple], int] = (hit, [], n * bs)
        if n >= last or not self.enable_caching or req.skip_reading_prefix_cache:
            return best
        hashes = {g.group: g._hashes(req, last) for g in self.groups}
        found: dict[tuple[int, int], Any] = {}

        def find_once(group: int, h: int, key: tuple) -> Any:      # a window's blocks are asked for at every m
            if (group, h) not in found:
                found[group, h] = find(group, h, key)
            return found[group, h]
        full_table, full_loads = list(hit[full]) if hit else [], []
        for m in range(n + 1, last + 1):
            entry = self._full._entry(req, hashes[self._full.group], m - 1, find_once, full_loads)
            if entry is None:
                break
            full_table.append(entry)
            tables, loads = [], list(full_loads)
            for g in self.groups:
                table = list(full_table) if g is self._full else self._window_table(g, req, hashes[g.group], m,
                                                                                    find_once, loads)
                if table is None:
                    break
                tables.append(table)
            else:
                best = (tables, loads, m * bs)
        return best

    @staticmethod
    def _window_table(g: KVCacheManager, req: Request, hashes: list[int], m: int, find: Finder, loads: list
                      ) -> Optional[list[int]]:
        """A window group's table for a hit on m blocks: NO_BLOCK before its window, then each block cached or
        LOAD; None if one is neither."""
        first = max(0, m * g.block_size - g.sliding_window + 1) // g.block_size
        table = [NO_BLOCK] * first
        for i in range(first, m):
            entry = g._entry(req, hashes, i, find, loads)
            if entry is None:
                return None
            table.append(entry)
        return table

    def fill_loads(self, req: Request) -> None:
        for g in self.groups:
            g.fill_loads(req)

    def _hits(self, computed: list[list[int]]) -> list[list[int]]:
        return computed or [[] for _ in self.groups]

    def can_allocate(self, req: Request, num_new_tokens: int, computed: list[list[int]] = ()) -> bool:
        demands = [g.demand(req, num_new_tokens, c) for g, c in zip(self.groups, self._hits(computed))]
        return sum(d for d, _ in demands) <= self.num_free_blocks + sum(f for _, f in demands)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[list[int]] = ()) -> bool:
        hits = self._hits(computed)
        for g in self.groups:        # blocks the windows have passed go back first, as a single group's would
            g.free_passed(req)
        if sum(g.demand(req, num_new_tokens, c)[0] for g, c in zip(self.groups, hits)) > self.num_free_blocks:
            return False
        for g, c in zip(self.groups, hits):     # every group's hit first: a new block may evict a cached one
            g.take_hit(req, c)
        self.fill_loads(req)
        for g, c in zip(self.groups, hits):
            g.grow(req, num_new_tokens, len(c))
        return True

    def trim(self, req: Request) -> None:
        for g in self.groups:
            g.trim(req)

    def free(self, req: Request) -> None:
        for g in self.groups:
            g.free(req)

    def reset_hashes(self, req: Request) -> None:
        for g in self.groups:
            g.reset_hashes(req)

    def check_integrity(self) -> None:
        _check_pool(self.pool, [g.req_blocks for g in self.groups])
