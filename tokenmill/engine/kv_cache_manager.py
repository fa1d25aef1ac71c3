"""The paged KV cache's bookkeeping: a block pool with ref counts, a free queue and a prefix-cache hash chain.

Plain Python over integers; the runner owns the tensors. Invariants (check_integrity):
free + in use == total; a block is in the free queue iff its ref count is 0; the prefix-cache map points only
at blocks that carry that hash; ref counts equal the number of requests holding each block.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from tokenmill.engine.request import Request

NO_BLOCK = -1   # a block-table entry whose block a sliding window freed


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[int] = None
    key: Optional[tuple] = None           # (parent hash, token ids, extra keys): verified on a hit


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: Optional[int] = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # a sliding window frees blocks mid-sequence, which the hash chain cannot describe: no caching then
        self.enable_caching = enable_caching and sliding_window is None
        self.sliding_window = sliding_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}                  # block hash -> block id
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
    def _block_key(self, parent: Optional[int], tokens: list[int]) -> tuple:
        return (parent, tuple(tokens), None)     # extra keys (LoRA, multimodal) would join here

    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """The hash chain over req's first num_full_blocks full blocks, extended incrementally."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash(self._block_key(parent, req.all_token_ids[i * bs:(i + 1) * bs])))
        return hashes

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
            bid = self.cached.get(hashes[i])
            if bid is None:
                break
            parent = hashes[i - 1] if i else None
            if self.blocks[bid].key != self._block_key(parent, req.all_token_ids[i * bs:(i + 1) * bs]):
                break      # a hash collision: treat as a miss
            hit.append(bid)
        self.num_queries += req.num_tokens
        self.num_hits += len(hit) * bs
        return hit, len(hit) * bs

    # ---- allocation ----------------------------------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Whether allocate_slots would succeed now, counting the blocks a sliding window would free first."""
        table = self.req_blocks.get(req.request_id, [])
        freed = 0
        if self.sliding_window is not None:
            freed = sum(1 for b in table[:self._first_needed(req) // self.block_size] if b != NO_BLOCK)
        return self._new_blocks(req, table, num_new_tokens, computed_blocks) <= self.num_free_blocks + freed

    def _new_blocks(self, req: Request, table: list[int], num_new_tokens: int, computed_blocks) -> int:
        """Blocks the pool must supply for num_new_tokens more tokens of req: its own new ones, and the hit blocks
        that sit in the free queue (a hit takes them out of it, so they can't be counted as free)."""
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(table) - len(computed_blocks)
        return need + sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for num_new_tokens more tokens of req (after computed_blocks, a prefix hit, on first call).

        Returns False, changing nothing, when the pool cannot supply the blocks."""
        table = self.req_blocks.setdefault(req.request_id, [])
        if self.sliding_window is not None:
            self._free_out_of_window(req, table)
        if self._new_blocks(req, table, num_new_tokens, computed_blocks) > self.num_free_blocks:
            return False
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(table) - len(computed_blocks)
        for b in computed_blocks:
            blk = self.blocks[b]
            if blk.ref_cnt == 0:
                del self.free_queue[b]
            blk.ref_cnt += 1
            table.append(b)
        for _ in range(max(need, 0)):
            table.append(self._pop_free())
        if self.enable_caching:     # speculative guesses are not tokens of the request yet: never cached
            self._cache_full_blocks(req, table, min(total, req.num_tokens))
        return True

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
            blk.block_hash, blk.key = None, None
        blk.ref_cnt = 1
        return bid

    def _cache_full_blocks(self, req: Request, table: list[int], num_tokens: int) -> None:
        """Register the blocks that these tokens fill: they hold known tokens once this step's forward ran."""
        bs = self.block_size
        full = num_tokens // bs
        hashes = self._hashes(req, full)
        for i in range(full):
            blk = self.blocks[table[i]]
            if blk.block_hash is not None:
                continue
            parent = hashes[i - 1] if i else None
            blk.block_hash = hashes[i]
            blk.key = self._block_key(parent, req.all_token_ids[i * bs:(i + 1) * bs])
            self.cached.setdefault(hashes[i], blk.block_id)

    def _free_out_of_window(self, req: Request, table: list[int]) -> None:
        """Give back blocks that no future query of req can attend (all positions < next_pos - window + 1)."""
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

    # ---- invariants ----------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        refs = [0] * self.num_blocks
        for table in self.req_blocks.values():
            for b in table:
                if b != NO_BLOCK:
                    refs[b] += 1
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached_free = sum(1 for b in self.free_queue if self.blocks[b].block_hash is not None)
        uncached_free = self.num_free_blocks - cached_free
        assert uncached_free + cached_free + in_use == self.num_blocks, "free + cached + in use != total"
        for b in self.blocks:
            assert b.ref_cnt == refs[b.block_id], f"block {b.block_id}: ref {b.ref_cnt} != holders {refs[b.block_id]}"
            assert (b.ref_cnt == 0) == (b.block_id in self.free_queue), f"block {b.block_id} free-queue mismatch"
        for h, bid in self.cached.items():
            assert self.blocks[bid].block_hash == h, f"cache map points at block {bid} without hash"
