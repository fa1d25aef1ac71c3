"""Percentiles, per-request latency records, goodput and serving summaries. Plain Python, seconds inside,
milliseconds in reports (the unit people quote TTFT and ITL in)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), p in [0, 100]."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = p / 100 * (len(xs) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: Iterable[float], scale: float = 1.0,
              percentiles: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """{"n", "mean", "min", "max", "p50", ...} of values × scale (scale=1000 turns seconds into ms)."""
    xs = [v * scale for v in values if v is not None and not math.isnan(v)]
    out: dict[str, float] = {"n": len(xs), "mean": sum(xs) / len(xs) if xs else math.nan,
                             "min": min(xs, default=math.nan), "max": max(xs, default=math.nan)}
    for p in percentiles:
        out[f"p{p:g}"] = percentile(xs, p)
    return out


@dataclass
class RequestRecord:
    """What a client saw of one request (timestamps relative to the benchmark start)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: Optional[float] = None
    itl: list[float] = field(default_factory=list)  # gaps between successive streamed chunks
    e2e: Optional[float] = None
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1), vLLM's definition."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tpot": self.tpot}


def meets_slo(r: RequestRecord, slo_ttft_s: Optional[float], slo_tpot_s: Optional[float]) -> bool:
    """A failed request never meets an SLO; a one-token request has no TPOT and passes that half."""
    if not r.success or r.ttft is None:
        return False
    if slo_ttft_s is not None and r.ttft > slo_ttft_s:
        return False
    tpot = r.tpot
    return not (slo_tpot_s is not None and tpot is not None and tpot > slo_tpot_s)


def goodput(records: Sequence[RequestRecord], duration_s: float, slo_ttft_s: Optional[float] = None,
            slo_tpot_s: Optional[float] = None) -> dict[str, float]:
    """Share of all requests meeting both SLOs, and those requests per second."""
    good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
    return {"good_requests": good,
            "goodput_share": good / len(records) if records else math.nan,
            "goodput_req_s": good / duration_s if duration_s > 0 else math.nan}


def serving_summary(records: Sequence[RequestRecord], duration_s: float, slo_ttft_s: Optional[float] = None,
                    slo_tpot_s: Optional[float] = None) -> dict[str, Any]:
    """Throughput, latency percentiles (ms) and goodput over one run."""
    ok = [r for r in records if r.success]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    d = duration_s if duration_s > 0 else math.nan
    return {
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration_s, "prompt_tokens": in_tok, "output_tokens": out_tok,
        "request_throughput": len(ok) / d, "output_throughput": out_tok / d,
        "total_token_throughput": (in_tok + out_tok) / d,
        "ttft_ms": summarize((r.ttft for r in ok), 1000),
        "itl_ms": summarize((x for r in ok for x in r.itl), 1000),
        "tpot_ms": summarize((r.tpot for r in ok), 1000),
        "e2e_ms": summarize((r.e2e for r in ok), 1000),
        "slo": {"ttft_ms": None if slo_ttft_s is None else slo_ttft_s * 1000,
                "tpot_ms": None if slo_tpot_s is None else slo_tpot_s * 1000},
        **goodput(records, duration_s, slo_ttft_s, slo_tpot_s),
    }


def json_safe(obj: Any) -> Any:
    """NaN/inf are not JSON: report them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
