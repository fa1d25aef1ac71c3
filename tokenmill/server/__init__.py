"""The OpenAI-compatible server: build_app(engine_or_asyncllm) -> FastAPI app; `tokenmill serve` runs it."""
from typing import Any


def __getattr__(name: str) -> Any:
    # lazy: `tokenmill --help` imports server.cli, and should not pay for FastAPI and the engine
    if name == "build_app":
        from tokenmill.server.app import build_app
        return build_app
    raise AttributeError(name)


__all__ = ["build_app"]
