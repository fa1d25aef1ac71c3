"""The prefix cache's half for linear-attention layers (Qwen3.5's Gated DeltaNet): a cached prefix's KV is not
enough to resume a request there, since those layers keep a state, not KV. This is the index of state snapshots,
each the state of every linear layer after a block boundary of some request's tokens, keyed by the hash of the block
that ends there (the prefix cache's chain: a key names the whole prefix). A hit resumes from the longest cached
block that also has a snapshot, as SGLang's and vLLM's hybrid caches do.

Snapshots are taken where they pay: at the last boundary before a prompt's last token (the same prompt again, a
preempted request's recompute), and while a request decodes at each boundary it passes, the newest replacing its
predecessor (a conversation's next turn resumes where the last one ended). The slots are chosen here and travel in
the step's ScheduledRequest (state_load, state_save); the tensors are the runner's (LinearStates). A snapshot joins
the index once the step that writes it has run (commit), so no request of that step can load it early; the saves of
a step that never came back (it raised) are dropped before the next is scheduled (discard), their slots unwritten.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

from tokenmill.engine.request import Request


class StateSnapshots:
    def __init__(self, num_slots: int, block_size: int):
        self.block_size = block_size
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.index: OrderedDict[int, int] = OrderedDict()      # block hash -> slot, least recently used first
        self.pending: list[tuple[str, int, int, bool]] = []    # (request, hash, slot, decoding): the step's saves
        self.latest: dict[str, int] = {}                       # a decoding request's newest snapshot (its hash)

    def resume(self, hashes: list[int]) -> tuple[int, Optional[int]]:
        """For a prefix hit of len(hashes) blocks (their hashes): how many of them to keep, the longest run whose
        last block has a snapshot, and that snapshot's slot (0, None: none has one)."""
        for n in range(len(hashes), 0, -1):
            slot = self.index.get(hashes[n - 1])
            if slot is not None:
                self.index.move_to_end(hashes[n - 1])
                return n, slot
        return 0, None

    def save_points(self, req: Request, start: int, n: int) -> list[int]:
        """Where in tokens [start, start + n) of req this step's state is worth keeping: block boundaries past
        start, at most start + n."""
        bs, end = self.block_size, start + n
        prompt_point = (req.num_prompt_tokens - 1) // bs * bs
        points = [prompt_point] if start < prompt_point <= end else []
        if end % bs == 0 and end >= req.num_prompt_tokens and end > max(start, prompt_point):
            points.append(end)
        return points

    def save(self, req: Request, start: int, n: int, block_hash: Callable[[int], int]
             ) -> tuple[tuple[int, int], ...]:
        """The saves this step makes for req's tokens [start, start + n) (block_hash(i): the hash of its block i):
        (tokens into the step's rows, snapshot slot) each, in order."""
        saves = []
        for point in self.save_points(req, start, n):
            h = block_hash(point // self.block_size - 1)
            if h in self.index or any(p[1] == h for p in self.pending):
                continue
            if self.free_slots:
                slot = self.free_slots.pop()
            elif self.index:              # the least recently used goes; a load of it this step reads it first
                _, slot = self.index.popitem(last=False)
            else:
                break
            self.pending.append((req.request_id, h, slot, point >= req.num_prompt_tokens))
            saves.append((point - start, slot))
        return tuple(saves)

    def commit(self) -> None:
        """The step that wrote the pending snapshots has run: they join the index."""
        for rid, h, slot, decoding in self.pending:
            self.index[h] = slot
            if decoding:                  # the request's older decode snapshot is a shorter prefix of this one
                old = self.latest.get(rid)
                if old is not None and old != h and old in self.index:
                    self.free_slots.append(self.index.pop(old))
                self.latest[rid] = h
        self.pending = []

    def discard(self) -> None:
        """Saves a step planned that never ran to its end: their slots go back unwritten, nothing is indexed."""
        self.free_slots.extend(slot for _, _, slot, _ in self.pending)
        self.pending = []

    def forget(self, req_id: str) -> None:
        """A finished request: its snapshots stay, for whoever shares its prefix."""
        self.latest.pop(req_id, None)
