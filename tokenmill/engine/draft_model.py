"""The draft-model proposer: a smaller model of the same vocabulary guesses each decoding request's next k tokens.

The draft keeps its own paged KV cache (its own block pool, sized with the target's) holding, per request, the
tokens it was fed. After a step the guesses it was fed are compared with the verified tokens: the draft keeps the
accepted ones, drops the rest and catches up in one pass, then guesses one token a pass. A prompt is fed as the target
computes it, at most max_num_batched_tokens a step. A greedy request's guesses are the draft's argmax; a
sampled one's are drawn from the draft's distribution q, which travels with them to the verification (rejection
sampling against the target's p). A seeded request's guesses draw from its generator too, so its text depends on
when it could guess (a full pool, a busy step), though never its distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tokenmill.config import ModelConfig
from tokenmill.engine.kv_cache_manager import HybridKVCacheManager, KVCacheManager
from tokenmill.engine.spec_decode import SpeculativeConfig, guess_room
from tokenmill.executor.runner import ModelRunner
from tokenmill.executor.sampler import SamplingInput, make_generator

DRAFT_SEED_SALT = 0x5EED_D2AF7      # a seeded request's draft stream: another seed than its verification's


@dataclass
class DraftState:
    """One request in the draft's cache. The KVCacheManager reads request_id and num_computed_tokens."""
    request: Any                                        # the request it follows (a reused id starts over)
    fed: list[int] = field(default_factory=list)        # the tokens whose K/V the draft's cache holds, in order
    verified: int = 0                                   # fed[:verified] are the request's own tokens, not guesses
    # a seeded request's guesses draw from a stream of their own: the target's verification draws from the seed's
    generator: Optional[torch.Generator] = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_computed_tokens(self) -> int:
        return len(self.fed)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_draft_config(target: ModelConfig, draft: ModelConfig, max_model_len: int) -> None:
    """A draft must speak the target's vocabulary and reach as far as its requests (before its weights load)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft model's vocabulary has {draft.vocab_size} tokens and "
                         f"the target's {target.vocab_size}; a draft model must share the target's vocabulary")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model: the draft model's max_position_embeddings "
                         f"({draft.max_position_embeddings}) is below max_model_len={max_model_len}; lower "
                         f"max_model_len")


def check_draft_tokenizer(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Where both models have tokenizers, they must give every token the same id."""
    if target_tokenizer is not None and draft_tokenizer is not None \
            and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError("speculative_config.model: the draft model's tokenizer gives tokens other ids than the "
                         "target's; a draft model must use the target's tokenizer")


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, kv: KVCacheManager | HybridKVCacheManager,
                 max_model_len: int, max_num_batched_tokens: int):
        self.config = config
        self.runner = runner
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_catch_up = max_num_batched_tokens      # tokens the draft computes in a step, guesses aside
        self.states: dict[str, DraftState] = {}

    def propose(self, reqs: list[Any]) -> None:
        """Set spec_token_ids (and, sampling, spec_draft_probs) of each request in reqs, the running ones. The draft
        follows a prompt as the target computes it, and a request it is still behind catches up over several steps,
        guessing once it has; requests that left (finished, aborted, preempted) give their draft blocks back."""
        live = {r.request_id: r for r in reqs}
        for rid in [rid for rid, st in self.states.items() if live.get(rid) is not st.request]:
            self.kv.free(self.states.pop(rid))
        budget = self.max_catch_up
        todo: list[tuple[Any, DraftState, list[int], int]] = []      # request, state, tokens to feed, guesses
        for req in reqs:
            req.spec_token_ids, req.spec_draft_probs = [], None
            room = guess_room(req, self.config.num_speculative_tokens, self.max_model_len)
            prefilling = req.num_computed_tokens < req.num_tokens - 1
            if budget <= 0 or req.is_pooling or req.grammar is not None or not (room > 0 or prefilling):
                continue
            st = self.states.get(req.request_id)
            if st is None:
                seed = req.params.seed
                st = self.states[req.request_id] = DraftState(req, generator=None if seed is None else make_generator(
                    seed ^ DRAFT_SEED_SALT, self.runner.device))
            # what it fed past `verified` were guesses: it keeps those the step accepted, never the last token
            keep = st.verified + _common_prefix(st.fed[st.verified:], req.all_token_ids[st.verified:-1])
            del st.fed[keep:]
            st.verified = keep
            self.kv.trim(st)
            # a prompt is fed as far as the target has computed it, so the draft is ready when decoding starts
            end = req.num_computed_tokens if prefilling else req.num_tokens
            n = min(end - keep, budget)
            if n <= 0:
                continue
            guesses = room if keep + n == req.num_tokens else 0
            while n and not self.kv.allocate_slots(st, n + max(guesses - 1, 0)):
                n, guesses = (n, 0) if guesses else (n // 2, 0)     # a full pool: guesses go first, then tokens
            if n:
                budget -= n
                todo.append((req, st, req.all_token_ids[keep:keep + n], guesses))
        if todo:
            self._guess(todo)

    def _guess(self, todo: list[tuple[Any, DraftState, list[int], int]]) -> None:
        """Pass 0 feeds every request's tokens and draws the first guess of those caught up; pass j draws guess j+1
        from guess j."""
        for j in range(max(1, max(guesses for *_, guesses in todo))):
            batch = [(req, st, toks if j == 0 else req.spec_token_ids[-1:], guesses)
                     for req, st, toks, guesses in todo if j == 0 or guesses > j]
            logits = self.runner.last_logits([(toks, len(st.fed), self.kv.tables_of(st.request_id))
                                              for _, st, toks, _ in batch])
            for _, st, toks, _ in batch:
                st.fed.extend(toks)
                if j == 0:
                    st.verified = len(st.fed)
            rows = [i for i, (*_, guesses) in enumerate(batch) if guesses > j]
            if not rows:
                continue
            drafting = [batch[i][0] for i in rows]
            tokens, probs = self.runner.sampler.draw(logits[torch.tensor(rows, device=logits.device)], [
                SamplingInput(req.params, req.prompt_token_ids, req.output_token_ids + req.spec_token_ids,
                              st.generator, req.bad_words_token_ids) for req, st, *_ in (batch[i] for i in rows)])
            for req, tok, q in zip(drafting, tokens, probs):
                req.spec_token_ids.append(tok)
                if q is not None:
                    req.spec_draft_probs = (req.spec_draft_probs or []) + [q]

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for st in self.states.values():
            for table in self.kv.tables_of(st.request_id):
                assert len(table) >= -(-len(st.fed) // self.kv.block_size), st.request_id
