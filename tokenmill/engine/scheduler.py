"""One scheduling rule with a token budget (vLLM v1's): running requests first, then waiting ones.

Every request has num_tokens and num_computed_tokens; a step gives each scheduled request some of the
difference. A decode is one token, a prompt is many, a prompt that does not fit the budget is chunked,
a prefix-cache hit starts num_computed_tokens past zero. When the KV pool runs dry the newest running
request is preempted: its blocks are returned and it is recomputed later from its tokens so far.

Waiting requests are admitted in arrival order, except that the n sequences of one request (a group) queue
behind any other request that has fewer sequences running: one client's n=128 cannot hold the batch's seats
while another's n=1 waits for all of them.

Fair prefill (vLLM's knobs, SchedulerConfig): no request computes more than long_prefill_token_threshold tokens in
a step, so a long prompt leaves the budget to others and its steps stay short; with max_num_partial_prefills > 1 a
prompt that a step would leave part-computed starts only within that many such prompts, and a long one only within
max_long_partial_prefills long ones: it is passed over (it keeps its place) and shorter prompts behind it start.
Where a step costs what it computes (a CPU: SchedulerConfig.prefill_depth_cost, short_prompts_first), a long
prompt's chunk also shrinks as its attention span grows, and a short prompt that can start has a step without the
long prompts' chunks (never two running), so it waits at most for the step in progress.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
import itertools
import time
from typing import Optional

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.kv_offload import KVOffload
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.state_snapshots import StateSnapshots
from tokenmill.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput


@dataclass
class SchedulerStats:
    """Per-step figures the metrics and diagnosis read."""
    num_running: int = 0
    num_waiting: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0          # in this step
    prefix_cache_queries: int = 0     # cumulative, in tokens
    prefix_cache_hits: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, offload: Optional[KVOffload] = None,
                 snapshots: Optional[StateSnapshots] = None):
        self.config = config
        self.kv = kv
        self.offload = offload                      # the prefix cache's tiers below the pool (None: none)
        self.snapshots = snapshots                  # linear-attention layers' states at cached boundaries
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}      # every unfinished request, by id
        self.total_preemptions = 0
        self._finished: list[str] = []              # finished since the last step, for the runner to forget
        # unfinished requests that sample from their past tokens on the host (async scheduling waits for them)
        self.num_history_readers = 0
        self._deferred = False                      # the last step left long prompts out for a short one

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.requests[req.request_id] = req
        self.num_history_readers += self._reads_history(req)

    @staticmethod
    def _reads_history(req: Request) -> bool:
        return req.params is not None and req.params.reads_history

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, in_flight: bool = False) -> SchedulerOutput:
        """in_flight (async scheduling): this step goes to the device before the last one is back; its computed
        tokens count at once, and a request whose tokens are still to come is scheduled as if they were there."""
        if self.snapshots is not None:     # saves the last step planned and did not finish (it raised)
            self.snapshots.discard()
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        cap = threshold or budget     # a request's tokens in one step (a long prompt's: _cap, by its depth)
        out = SchedulerOutput(finished_req_ids=self._finished)
        self._finished = []
        partial: list[tuple[Request, int, bool]] = []    # prompts this step leaves part-computed: (request, its
        # tokens computed by the end of the step, whether it is long)
        defer, self._deferred = self._short_prompt_waits(), False
        shaped = self.config.short_prompts_first or self.config.prefill_depth_cost > 0   # the CPU rules are on
        # 1. running requests: their next token (decode) or their next prompt chunk
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._nothing_to_compute(req):        # (async scheduling) its last tokens are on their way
                i += 1
                continue
            left = self._target(req) - req.num_computed_tokens
            long = shaped and self._long_prefill(req, left)
            if defer and long:                       # a long prompt sits this step out for a short one
                partial.append((req, req.num_computed_tokens, True))
                self._deferred = True
                i += 1
                continue
            n = self._fit(req, min(left + len(req.spec_token_ids), budget, self._cap(long, req.num_computed_tokens)))
            while not self.kv.allocate_slots(req, n):
                if req.spec_token_ids:               # guesses give way before any request is preempted for them
                    n = min(n, req.num_tokens - req.num_computed_tokens)
                    req.spec_token_ids, req.spec_draft_probs = [], None
                    continue
                victim = self.running.pop()          # the newest request gives its blocks back
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            self._count_partial(partial, req, left, n)
            self._add_to_batch(out, req, n, in_flight)
            budget -= n
            i += 1
        # 2. waiting requests, in arrival order (preempted ones were put back at the front), groups taking turns;
        # a prompt held back (the partial-prefill limits, a step left to short prompts, or a shared prefix still being
        # computed) keeps its place while later ones are considered
        seats = Counter(r.group_id for r in self.running) if self.waiting else Counter()
        adapters = {r.lora_key for r in self.running if r.lora is not None} if self.config.max_loras else set()
        held: set[str] = set()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not out.preempted_req_ids:
            req = self._next_waiting(seats, held)
            if req is None:
                break
            left = self._target(req) - req.num_computed_tokens     # (a prefix-cache hit aside, as vLLM counts)
            if (left > min(budget, cap) and not self._may_start_partial(partial, left)) \
                    or (defer and left > threshold) or self._prefix_in_progress(req, partial) \
                    or self._one_adapter_too_many(req, adapters):
                held.add(req.request_id)
                continue
            hit_blocks, hit_tokens = ([], 0)
            loads: list = []                 # (group, block index, (tier, payload)) of the blocks a tier holds
            load = None                      # the state snapshot a linear-attention model's hit resumes from
            if req.num_computed_tokens == 0:
                hit_blocks, hit_tokens = self.kv.get_computed_blocks(req)
                if self.snapshots is not None and hit_blocks:
                    hit_blocks, hit_tokens, load = self._resumable(req, hit_blocks)
            pool_tokens = hit_tokens
            if req.num_computed_tokens == 0 and self.offload is not None:
                hit_blocks, loads, hit_tokens = self.kv.extend_hit(req, hit_blocks, self._finder())
            left -= hit_tokens
            n = self._fit(req, min(left, budget, self._cap(left > threshold, req.num_computed_tokens + hit_tokens)),
                          hit_blocks)
            if not self.kv.allocate_slots(req, n, hit_blocks):
                break                                  # wait for running requests to free blocks
            if loads:                                  # fresh blocks, filled before this step's forward runs
                tables = self.kv.tables_of(req.request_id)
                out.kv_loads.append((tuple(tables[g][i] for g, i, _ in loads), tuple(p for _, _, (_, p) in loads)))
            if self.offload is not None and (loads or req.num_cached_tokens < 0):     # a first admission's lookup
                self.offload.count(req.num_tokens - pool_tokens, loads, self.kv.full_group, self.kv.block_size)
            self.waiting.remove(req)
            seats[req.group_id] += 1
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit_tokens
            req.num_computed_tokens += hit_tokens
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            self.running.append(req)
            if req.lora is not None:
                adapters.add(req.lora_key)
            self._count_partial(partial, req, left, n)
            self._add_to_batch(out, req, n, in_flight, load)
            budget -= n
        return out

    def _resumable(self, req: Request, hit: list[int]) -> tuple[list[int], int, Optional[int]]:
        """A prefix hit cut back to its longest run of blocks whose end has a state snapshot: (blocks, tokens, the
        snapshot's slot)."""
        keep, slot = self.snapshots.resume(self.kv.block_hashes(req, len(hit)))
        self.kv.num_hits -= (len(hit) - keep) * self.kv.block_size
        return hit[:keep], keep * self.kv.block_size, slot

    MIN_DEEP_CHUNK = 16       # prefill_depth_cost shrinks a chunk to no fewer tokens (the steps' fixed cost)

    def _cap(self, long: bool, depth: int) -> int:
        """The most tokens a request computes in a step from `depth` on: the threshold (else the budget); for a long
        prompt with prefill_depth_cost, what costs as much as half the threshold at the start (a newcomer waits on
        average half the step in progress: so about a short prompt's own step)."""
        c = self.config
        t = c.long_prefill_token_threshold
        if not t:
            return c.max_num_batched_tokens
        if c.prefill_depth_cost and long:
            return max(min(t, self.MIN_DEEP_CHUNK), int(t / (2 * (1 + depth * c.prefill_depth_cost))))
        return t

    def _long_prefill(self, req: Request, left: int) -> bool:
        """Whether req, running with `left` tokens to compute, is a long prompt: more than the threshold left, or the
        rest of a prompt that was long when it started (its last chunks are as deep as any)."""
        t = self.config.long_prefill_token_threshold
        return left > t or (req.num_computed_tokens < req.num_prompt_tokens
                            and req.num_prompt_tokens - max(req.num_cached_tokens, 0) > t)

    def _short_prompt_waits(self, scan: int = 64) -> bool:
        """short_prompts_first: whether a prompt within the threshold waits with a seat free for it, and the last
        step did not leave long prompts out already (they lose at most every other step)."""
        c = self.config
        if not c.short_prompts_first or self._deferred or len(self.running) >= c.max_num_seqs:
            return False
        return any(r.status is RequestStatus.WAITING and r.num_tokens - r.num_computed_tokens
                   <= c.long_prefill_token_threshold for r in itertools.islice(self.waiting, scan))

    @staticmethod
    def _target(req: Request) -> int:
        """The tokens req will have once the tokens in flight are back (async scheduling; else its tokens)."""
        return req.num_tokens + req.num_in_flight

    def _nothing_to_compute(self, req: Request) -> bool:
        """Async scheduling: every token of req is scheduled (a pooling request's whole prompt), or its tokens in
        flight reach max_tokens or max_model_len (the step that brings them back finishes it)."""
        if self._target(req) <= req.num_computed_tokens:
            return True
        return req.num_in_flight > 0 and (len(req.output_token_ids) + req.num_in_flight >= req.max_tokens
                                          or self._target(req) >= self.config.max_model_len)

    def _next_waiting(self, seats: Counter, held: set[str], scan: int = 512) -> Optional[Request]:
        """The first waiting request whose group has the fewest sequences running (of the first `scan`, those held
        back this step aside: the search stops at the first with none, so one-sequence requests stay in plain
        arrival order). A preempted request goes first: it held its seat already."""
        best = None
        for i, req in enumerate(self.waiting):
            if i >= scan:
                break
            if req.request_id in held:
                continue
            if best is None:
                best = req
                if req.status is RequestStatus.PREEMPTED or seats[req.group_id] == 0:
                    break
            elif seats[req.group_id] < seats[best.group_id]:
                best = req
                if seats[req.group_id] == 0:
                    break
        return best

    def _one_adapter_too_many(self, req: Request, adapters: set) -> bool:
        """Whether the request's LoRA adapter would be one more than max_loras among the running requests' (it
        waits for one of them to finish; never refused)."""
        return req.lora is not None and req.lora_key not in adapters and len(adapters) >= self.config.max_loras

    def _count_partial(self, partial: list, req: Request, left: int, n: int) -> None:
        """req, with `left` tokens to compute, got n of them this step (before they are counted): a prompt it leaves
        part-computed?"""
        if n < left:
            partial.append((req, req.num_computed_tokens + n, left > self.config.long_prefill_token_threshold))

    def _may_start_partial(self, partial: list, left: int) -> bool:
        """Whether a waiting prompt with `left` tokens to compute may start although this step will not finish it
        (vLLM's concurrent partial prefills: limited only when max_num_partial_prefills > 1)."""
        c = self.config
        if c.max_num_partial_prefills == 1:
            return True
        is_long = left > c.long_prefill_token_threshold
        return len(partial) < c.max_num_partial_prefills and \
            (not is_long or sum(long for _, _, long in partial) < c.max_long_partial_prefills)

    def _prefix_in_progress(self, req: Request, partial: list) -> bool:
        """Whether req's prompt goes on into a full block that a prompt of this step shares but reaches only in a
        later step: started now, req would compute that block again; a step or a few later it is a cache hit (with
        chunks capped, requests that share a long prefix often arrive while it is being computed)."""
        if not partial or req.num_computed_tokens or not self.kv.enable_caching or req.skip_reading_prefix_cache:
            return False
        bs = self.kv.block_size
        for other, reached, _ in partial:
            if self.snapshots is not None:   # linear-attention layers resume only at a snapshot: other's prompt point
                point = self.snapshots.save_points(other, 0, other.num_prompt_tokens)[:1]
                if not point or point[0] >= req.num_tokens or req.all_token_ids[:point[0]] != other.all_token_ids[
                        :point[0]]:
                    continue
            end = (reached // bs + 1) * bs           # the end of the first block `other` has not finished
            if end < req.num_tokens and end <= other.num_tokens and other.cache_salt == req.cache_salt \
                    and req.all_token_ids[:end] == other.all_token_ids[:end]:
                return True
        return False

    def _finder(self):
        """The offload tiers' lookup for KVCacheManager.extend_hit, with this schedule's evictions."""
        evicted = self.kv.pool.evicted
        return lambda group, h, key: self.offload.find(group, h, key, evicted)

    def _fit(self, req: Request, n: int, hit_blocks: list[int] = ()) -> int:
        """n, or under a sliding window a shorter prompt chunk that fits the free blocks: a chunk needs the window's
        blocks plus its own, so a long chunk may never fit a pool sized for a window, while a short one always
        does (blocks before the window are freed as it moves)."""
        if self.kv.sliding_window is None:
            return n
        while n > 1 and not self.kv.can_allocate(req, n, hit_blocks):
            n //= 2
        return n

    def _add_to_batch(self, out: SchedulerOutput, req: Request, n: int, in_flight: bool,
                      load: Optional[int] = None) -> None:
        target = self._target(req)
        guesses = max(n - (target - req.num_computed_tokens), 0)
        save = ()
        if self.snapshots is not None and not guesses:    # a verification's state is known only once it is back
            start = req.num_computed_tokens
            save = self.snapshots.save(req, start, n, lambda i: self.kv.block_hashes(req, i + 1)[i])
        tables = self.kv.tables_of(req.request_id)
        if len(req.blocks_synced) != len(tables):
            req.blocks_synced = [0] * len(tables)
        deltas = tuple((k, tuple(t[k:])) for k, t in zip(req.blocks_synced, tables))
        req.blocks_synced = [len(t) for t in tables]
        new = None
        if not req.runner_knows:
            req.runner_knows = True
            new = NewRequestData(req.request_id, tuple(req.prompt_token_ids), req.params,
                                 req.pooling_type if req.is_pooling else None,
                                 tuple(tuple(w) for w in req.bad_words_token_ids), req.lora)
        out.scheduled.append(ScheduledRequest(
            req.request_id, n, req.num_computed_tokens, deltas, tuple(req.spec_token_ids[:guesses]),
            tuple(req.spec_draft_probs[:guesses]) if guesses and req.spec_draft_probs is not None else None, new,
            load, save))
        if n == 1 + guesses and (req.output_token_ids or req.num_in_flight) and req.num_computed_tokens == target - 1:
            out.num_decode_tokens += n
        else:
            out.num_prefill_tokens += n
        if in_flight:          # counted now: the next step is scheduled before this one is back
            req.num_computed_tokens += n
            if req.num_computed_tokens == target and not req.is_pooling:
                req.num_in_flight += 1

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.blocks_synced = []          # the runner's tables of it are stale: they are sent whole again
        req.spec_token_ids, req.spec_draft_probs = [], None
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]], in_flight: bool = False,
               reqs: Optional[list[Request]] = None) -> None:
        """Advance computed counts; append the tokens sampled for requests that reached their end. A request that
        verified guesses got the accepted ones and one more: the KV of the rejected ones is dropped (its count rolled
        back, blocks that only they used returned)."""
        if in_flight:           # a step schedule(in_flight=True) made
            return self._update_async(reqs, sampled)
        if self.snapshots is not None:
            self.snapshots.commit()
        for s in out.scheduled:
            req = self.requests.get(s.req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_tokens
            toks = sampled.get(req.request_id)
            if toks is None:
                continue
            if s.spec_token_ids:
                req.num_computed_tokens -= len(s.spec_token_ids) - (len(toks) - 1)
                self.kv.trim(req)
                req.blocks_synced = [min(k, len(t)) for k, t in zip(req.blocks_synced,
                                                                     self.kv.tables_of(req.request_id))]
            req.spec_token_ids, req.spec_draft_probs = [], None    # spent: the proposer guesses again
            for tok in toks:
                req.append_token(tok)
            if not self.config.use_kv_cache:
                req.num_computed_tokens = 0        # forget the cache: recompute everything next step

    @staticmethod
    def _update_async(reqs: list[Request], sampled: dict[str, list[int]]) -> None:
        """A step scheduled asynchronously is back (reqs: its requests, in batch order): its computed tokens were
        counted when it was scheduled; its sampled tokens are appended (a request preempted since keeps them: it
        recomputes them later; one finished since, or a new one of its id, is left alone)."""
        for req in reqs:
            toks = sampled.get(req.request_id)
            if req.is_finished or toks is None:
                continue
            req.num_in_flight -= 1
            for tok in toks:
                req.append_token(tok)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a request out (finished or aborted) and return its blocks."""
        req.status = status
        if self.snapshots is not None:
            self.snapshots.forget(req.request_id)
        if self.requests.pop(req.request_id, None) is not None:
            self.num_history_readers -= self._reads_history(req)
            if req.runner_knows:
                self._finished.append(req.request_id)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)

    def stats(self, out: SchedulerOutput) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=out.num_decode_tokens,
            kv_blocks_used=self.kv.num_used_blocks, kv_usage=self.kv.usage,
            num_preemptions=len(out.preempted_req_ids),
            prefix_cache_queries=self.kv.num_queries, prefix_cache_hits=self.kv.num_hits)
