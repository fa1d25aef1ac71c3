from tokenmill.executor.attention.backend import AttentionMetadata, AttentionBackend, get_backend

__all__ = ["AttentionMetadata", "AttentionBackend", "get_backend"]
