"""PoolingParams with vLLM's names: a request that asks for an embedding of its prompt instead of new tokens.

Which tokens are pooled is the engine's choice (`pooling_type`, as vLLM's pooler config), not the request's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

POOLING_TYPES = ("LAST", "MEAN")    # the final-norm hidden state of the last prompt token, or the mean over all


@dataclass(frozen=True)
class PoolingParams:
    normalize: bool = True              # L2-normalise the pooled vector (vLLM's default for embeddings)
    dimensions: Optional[int] = None    # None or the model's hidden size: decoder LMs are not matryoshka-trained

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize must be True or False, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be a positive integer or None, got {self.dimensions!r}")


def check_pooling_type(pooling_type: str) -> str:
    """The canonical (upper-case) name, or a ValueError that lists the choices."""
    name = pooling_type.upper() if isinstance(pooling_type, str) else pooling_type
    if name not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}")
    return name
