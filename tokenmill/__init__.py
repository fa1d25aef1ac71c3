"""tokenmill: a readable LLM inference engine (paged KV cache, continuous batching, OpenAI-compatible server)."""
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code: load it on first use so `import tokenmill` stays light
    if name == "LLM":
        from tokenmill.llm import LLM
        return LLM
    if name == "LLMEngine":
        from tokenmill.engine.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics"]
