"""Property tests: the block manager and scheduler never leak or double-free, whatever the request mix."""
import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache_manager import NO_BLOCK, HybridKVCacheManager, KVCacheManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

BS = 4
ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 2)),
    st.tuples(st.just("step")),
    st.tuples(st.just("guess"), st.integers(1, 6), st.integers(0, 6)),    # speculative guesses, how many stand
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
), min_size=1, max_size=60)


def make_request(i: int, plen: int, max_tokens: int, family: int) -> Request:
    # requests of the same family share a prefix, so prefix-cache hits happen
    prompt = [family * 7 + 1] * 8 + [i % 13 + 100 + j for j in range(plen)]
    return Request(str(i), prompt, SamplingParams(max_tokens=max_tokens), 0.0, max_tokens, ())


def _sampled(sched: Scheduler, out, accept: int) -> dict[str, list[int]]:
    """Tokens for the requests that reached their end: the first `accept` of their guesses and one more."""
    res = {}
    for s in out.scheduled:
        r = sched.requests[s.req_id]
        if r.num_computed_tokens + s.num_tokens - len(s.spec_token_ids) == r.num_tokens:
            res[r.request_id] = list(s.spec_token_ids[:accept]) + [5]
    return res


def _mirror(runner_tables: dict[str, list[list[int]]], out) -> None:
    """What the runner keeps of the block tables, from the step's deltas alone."""
    for rid in out.finished_req_ids:
        runner_tables.pop(rid, None)
    for s in out.scheduled:
        tables = runner_tables.setdefault(s.req_id, [[] for _ in s.block_deltas])
        for table, (keep, new) in zip(tables, s.block_deltas):
            del table[keep:]
            table.extend(new)


def _check_mirror(runner_tables: dict[str, list[list[int]]], kv, out) -> None:
    """The runner's tables equal the manager's wherever a block is still held (a window's freed entries may stay
    stale: no query attends them)."""
    for s in out.scheduled:
        for mine, theirs in zip(runner_tables[s.req_id], kv.tables_of(s.req_id)):
            assert len(mine) == len(theirs)
            assert all(b == t for b, t in zip(mine, theirs) if t != NO_BLOCK)


WINDOW = 6     # the hybrid cache's window groups (Gemma's local layers), in tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(12, 40), budget=st.integers(1, 24), caching=st.booleans(),
       hybrid=st.booleans())
def test_random_operations_keep_integrity(ops, num_blocks, budget, caching, hybrid):
    """The plain cache, and a hybrid one (a full-attention group and two window groups over one pool)."""
    kv = HybridKVCacheManager(num_blocks, BS, caching, [None, WINDOW, WINDOW]) if hybrid else \
        KVCacheManager(num_blocks, BS, enable_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=64), kv)
    live: list[Request] = []
    runner_tables: dict[str, list[list[int]]] = {}
    accept = 0
    for n, op in enumerate(ops):
        if op[0] == "add":
            req = make_request(n, op[1], op[2], op[3])
            if kv.blocks_needed(req.num_tokens + req.max_tokens) <= num_blocks:
                sched.add(req)
                live.append(req)
        elif op[0] == "guess":      # the decoding requests guess; the next step accepts some of each one's guesses
            for r in sched.running:
                if r.num_computed_tokens == r.num_tokens - 1:
                    r.spec_token_ids = [7] * min(op[1], r.max_tokens - len(r.output_token_ids) - 1, 63 - r.num_tokens)
            accept = op[2]
        elif op[0] == "step":
            for r in sched.running:      # the scheduler fits chunks by can_allocate: it must say what happens
                assert kv.can_allocate(r, 3) == copy.deepcopy(kv).allocate_slots(r, 3)
            out = sched.schedule()
            assert out.total_tokens <= budget
            _mirror(runner_tables, out)
            _check_mirror(runner_tables, kv, out)
            for s in out.scheduled:       # a window group has given back the blocks its window passed
                r = sched.requests[s.req_id]
                for table in kv.tables_of(r.request_id)[1:]:
                    passed = max(0, r.num_computed_tokens - WINDOW + 1) // BS
                    assert all(b == NO_BLOCK for b in table[:passed]), "a window group kept a passed block"
            sched.update(out, _sampled(sched, out, accept))
            for r in list(sched.running):
                if len(r.output_token_ids) >= r.max_tokens:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
        elif live:
            req = live[op[1] % len(live)]
            if not req.is_finished:
                sched.finish(req, RequestStatus.FINISHED_ABORTED if op[0] == "abort" else RequestStatus.FINISHED_STOPPED)
        kv.check_integrity()
        for r in sched.running:   # a request holds exactly the blocks its computed tokens need (a window, at most
            # the blocks that its window and the next chunk reach)
            for table in kv.tables_of(r.request_id):
                assert len(table) == -(-r.num_computed_tokens // BS)
        for r in sched.waiting:
            assert all(t == [] for t in kv.tables_of(r.request_id))
    # drain: everything finishes, nothing deadlocks, every block comes back
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert not out.is_empty, "scheduler made no progress with requests waiting"
        _mirror(runner_tables, out)
        _check_mirror(runner_tables, kv, out)
        sched.update(out, _sampled(sched, out, 0))
        for r in list(sched.running):
            if len(r.output_token_ids) >= r.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        kv.check_integrity()
    assert not sched.has_unfinished()
    assert kv.num_used_blocks == 0


def test_eviction_is_lru():
    """Freed cached blocks are evicted least recently freed first; uncached free blocks are used before them."""
    kv = KVCacheManager(8, BS)
    a = Request("a", list(range(9)), SamplingParams(), 0.0, 1, ())       # 2 full blocks + 1 partial
    b = Request("b", list(range(50, 59)), SamplingParams(), 0.0, 1, ())
    assert kv.allocate_slots(a, 9) and kv.allocate_slots(b, 9)
    a_blocks, b_blocks = list(kv.blocks_of("a")), list(kv.blocks_of("b"))
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    # the two uncached blocks (the partial tails) and the 2 never-used blocks come first, then a's, then b's
    order = list(kv.free_queue)
    cached_order = [x for x in order if kv.blocks[x].block_hash is not None]
    assert cached_order == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    assert set(order[:4]) == set(range(8)) - set(a_blocks[:2]) - set(b_blocks[:2])
    # allocating 5 blocks evicts exactly the least recently freed cached block (a's tail block)
    c = Request("c", list(range(100, 120)), SamplingParams(), 0.0, 1, ())
    assert kv.allocate_slots(c, 20)
    assert a_blocks[1] in kv.blocks_of("c") and a_blocks[0] not in kv.blocks_of("c")
    # a's first block is still cached and hits; its second is gone
    a2 = Request("a2", list(range(9)), SamplingParams(), 0.0, 1, ())
    hit, n = kv.get_computed_blocks(a2)
    assert hit == [a_blocks[0]] and n == BS
    kv.check_integrity()


def test_hit_never_covers_last_token():
    kv = KVCacheManager(8, BS)
    a = Request("a", list(range(8)), SamplingParams(), 0.0, 1, ())
    assert kv.allocate_slots(a, 8)
    kv.free(a)
    same = Request("b", list(range(8)), SamplingParams(), 0.0, 1, ())
    hit, n = kv.get_computed_blocks(same)
    assert n == 4 and len(hit) == 1      # block 2 would cover the last token: it must be computed
