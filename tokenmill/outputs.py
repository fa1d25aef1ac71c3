"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes (PoolingRequestOutput /
EmbeddingRequestOutput for pooling requests), plus per-request timings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:       # `import tokenmill` stays light: torch only for the annotation
    import torch


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# one dict per position: token id -> Logprob (the sampled token plus the top-N)
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of one request's life, and the derived phase figures."""
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> Optional[float]:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> Optional[float]:
        if self.last_token_time is None or self.first_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def e2e_latency(self) -> Optional[float]:
        end = self.finished_time or self.last_token_time
        return None if end is None else end - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        d = self.decode_time
        if not d or self.num_generation_tokens < 2:
            return None
        return (self.num_generation_tokens - 1) / d


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None      # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[int | str] = None  # the matched stop string or stop token id

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    num_cached_tokens: int = 0
    # vLLM's: on a prefill instance, where the prompt's KV went; "transfer" is a Future of what was sent
    kv_transfer_params: Optional[dict] = None


@dataclass
class PoolingOutput:
    data: torch.Tensor                       # the pooled (and, if asked, normalised) vector: float32 on the CPU


@dataclass
class PoolingRequestOutput:
    """What the engine hands back for a request made with PoolingParams (vLLM's shape)."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: Optional[str] = None
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result: `.outputs.embedding` is a list of floats (vLLM's shape)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @staticmethod
    def from_base(out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.outputs.data.tolist()),
                                      out.prompt_token_ids, out.finished)
