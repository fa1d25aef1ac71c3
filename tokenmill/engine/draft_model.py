"""The draft-model proposer: a smaller model of the same vocabulary guesses each decoding request's next k tokens.

The draft keeps its own paged KV cache (its own block pool, sized with the target's) holding, per request, the
tokens it was fed. After a step the verified tokens are compared with those: the draft keeps the common prefix (the
accepted guesses among it), drops the rest and catches up in one pass, then guesses one token a pass. A greedy
request's guesses are the draft's argmax; a sampled one's are drawn from the draft's distribution q, which travels
with them to the verification (rejection sampling against the target's p).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.spec_decode import SpeculativeConfig, guess_room
from tokenmill.executor.runner import ModelRunner
from tokenmill.executor.sampler import SamplingInput


@dataclass
class DraftState:
    """One request in the draft's cache. The KVCacheManager reads request_id and num_computed_tokens."""
    request_id: str
    fed: list[int] = field(default_factory=list)        # the tokens whose K/V the draft's cache holds, in order

    @property
    def num_computed_tokens(self) -> int:
        return len(self.fed)


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
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.runner = runner
        self.kv = kv
        self.max_model_len = max_model_len
        self.states: dict[str, DraftState] = {}

    def propose(self, reqs: list[Any]) -> None:
        """Set spec_token_ids (and, sampling, spec_draft_probs) of each request in reqs, the running ones; requests
        that left (finished, aborted, preempted) give their draft blocks back."""
        live = {r.request_id for r in reqs}
        for rid in [rid for rid in self.states if rid not in live]:
            self.kv.free(self.states.pop(rid))
        todo: list[tuple[Any, DraftState, int]] = []
        for req in reqs:
            req.spec_token_ids, req.spec_draft_probs = [], None
            room = guess_room(req, self.config.num_speculative_tokens, self.max_model_len)
            if room <= 0:
                continue
            st = self.states.setdefault(req.request_id, DraftState(req.request_id))
            keep, most = 0, min(len(st.fed), req.num_tokens - 1)      # the last token is always new to it
            while keep < most and st.fed[keep] == req.all_token_ids[keep]:
                keep += 1
            del st.fed[keep:]
            self.kv.trim(st)
            # slots for the tokens it has not seen and every guess but the last (which is never fed)
            if not self.kv.allocate_slots(st, req.num_tokens - keep + room - 1):
                self.kv.free(self.states.pop(req.request_id))     # the pool is full: no guesses this time
                continue
            if not req.params.greedy:
                req.spec_draft_probs = []
            todo.append((req, st, room))
        for j in range(max((room for _, _, room in todo), default=0)):
            batch = [(req, st) for req, st, room in todo if room > j]
            feed = [req.all_token_ids[len(st.fed):] if j == 0 else req.spec_token_ids[-1:] for req, st in batch]
            logits = self.runner.last_logits([(toks, len(st.fed), self.kv.blocks_of(st.request_id))
                                              for toks, (_, st) in zip(feed, batch)])
            guesses, probs = self.runner.sampler.draw(logits, [
                SamplingInput(req.params, req.prompt_token_ids, req.output_token_ids + req.spec_token_ids,
                              req.generator, req.bad_words_token_ids) for req, _ in batch])
            for (req, st), toks, tok, q in zip(batch, feed, guesses, probs):
                st.fed.extend(toks)
                req.spec_token_ids.append(tok)
                if q is not None:
                    req.spec_draft_probs.append(q)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for st in self.states.values():
            assert len(self.kv.blocks_of(st.request_id)) >= self.kv.blocks_needed(len(st.fed)), st.request_id
