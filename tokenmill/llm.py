"""The offline Python API, with vLLM's names: LLM(...).generate / .chat / .generate_stream / .embed."""
from __future__ import annotations

import itertools
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

from tokenmill.engine.engine import LLMEngine, PromptType
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]
PoolingArg = Union[PoolingParams, Sequence[PoolingParams], None]
LoRAArg = Union[LoRARequest, Sequence[Optional[LoRARequest]], None]


class StreamOutput(NamedTuple):
    """One piece of a stream: the text and token ids new since the request's last piece."""
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    index: int = 0                      # which of the n completions
    finish_reason: Optional[str] = None


class LLM:
    """Load a model and generate. `LLM()` runs the bundled SmolLM2-135M-Instruct.

    Engine options keep vLLM's names: dtype, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
    long_prefill_token_threshold, max_num_partial_prefills, max_long_partial_prefills (fair prefill; no cap here by
    default, since offline no request arrives mid-prefill: see SchedulerConfig),
    enable_prefix_caching, kv_cache_dtype ("auto"; "bfloat16": half the KV bytes, K/V rounded; "int8": about a
    quarter, a scale per 32 values of a token's kv head; "int4": groups of 32 with a scale and min; "fp8" / "fp8_e4m3" /
    "fp8_e5m2": 8-bit floats with a scale per kv head, 1.0 unless calculate_kv_scales=True computes it from a fixed
    passage's K/V at start-up), device, seed;
    kv_cache_memory_gb sizes the paged KV cache (default: a share of free memory); attention_backend picks the
    attention kernels; a GGUF's matrices stay in their quantised blocks (quantized_kernels=False dequantises them
    to float at load, the plain path); quantization="int8" or "int4" quantises a float checkpoint at load;
    Q4_K/Q5_K/Q6_K weights multiply activations rounded to int8 per 256, and Q4_0/Q4_1/Q8_0 ones in steps of up to
    16 rows per 32, as llama.cpp does (int8_activations=False
    keeps them float32, exact against the dequantised model);
    cpu_kernels picks the CPU kernel variant (auto, avx512, avx2, neon, generic) or "reference" (plain torch);
    pooling_type ("LAST" or "MEAN") is what embed() pools over the prompt; tensor_parallel_size splits the model over
    that many ranks on this machine (docs/parallelism.md); on a GPU, enforce_eager turns the decode steps'
    CUDA graphs off, compilation_config picks their sizes ({"cudagraph_capture_sizes": [...]}) and
    async_scheduling launches each step before the last one's tokens are back (docs/gpu.md); enable_lora serves LoRA
    adapters (max_loras at once, ranks up to max_lora_rank), each request's named by generate(lora_request=...)
    (docs/python-api.md)."""

    def __init__(self, model: Optional[str] = None, **engine_args: Any):
        if engine_args.pop("data_parallel_size", 1) != 1:
            raise ValueError("data_parallel_size is for serving: `tokenmill serve --data-parallel-size N` puts N "
                             "replicas behind one server; offline, run one LLM per process")
        if engine_args.get("long_prefill_token_threshold") is None:
            # offline every request is there from the start, so none arrives mid-prefill to wait for a long prompt:
            # no cap (a server's engine caps by default on a CPU, SchedulerConfig.default_long_prefill_token_threshold)
            engine_args["long_prefill_token_threshold"] = 0
        self.llm_engine = LLMEngine(model, **engine_args)
        self._ids = itertools.count()

    @property
    def model_config(self):
        return self.llm_engine.model_config

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_stats(self) -> dict[str, Any]:
        return self.llm_engine.stats.as_dict()

    # ---- submission ------------------------------------------------------------------------------------------
    def _submit(self, prompts: Union[PromptType, Sequence[PromptType]], params: Union[ParamsArg, PoolingArg],
                kind: type = SamplingParams, lora_request: LoRAArg = None) -> list[str]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, (SamplingParams, PoolingParams)):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} {kind.__name__} for {len(prompts)} prompts; "
                             f"pass one, or one per prompt")
        wrong = next((p for p in params if not isinstance(p, kind)), None)
        if wrong is not None:
            use = ("embed() takes PoolingParams (generate() generates)" if kind is PoolingParams
                   else "generate() takes SamplingParams (embed() pools)")
            raise ValueError(f"{use}; got a {type(wrong).__name__}")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts; pass one, or one per prompt")
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = str(next(self._ids))
                self.llm_engine.add_request(rid, prompt, p, lora_request=lora)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)     # all or nothing: leave the engine as it was
            raise
        return ids

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]], sampling_params: ParamsArg = None,
                 use_tqdm: bool = True, lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Outputs in input order. A progress bar shows for more than a few prompts (use_tqdm=False: none).
        lora_request: a LoRARequest for every prompt, or one per prompt (None: the base model)."""
        return self._run(self._submit(prompts, sampling_params, lora_request=lora_request), use_tqdm)

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: PoolingArg = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order: the final-norm hidden states pooled as the engine's pooling_type
        says (LAST token or MEAN over the prompt), L2-normalised unless PoolingParams(normalize=False)."""
        ids = self._submit(prompts, PoolingParams() if pooling_params is None else pooling_params, PoolingParams)
        return [EmbeddingRequestOutput.from_base(o) for o in self._run(ids, use_tqdm)]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        """Step until the requests ids finish; their final outputs in the order of ids."""
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[Any] = [None] * len(ids)
        bar = None
        if use_tqdm and len(ids) > 4:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.llm_engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results   # type: ignore[return-value]

    def generate_stream(self, prompts: Union[PromptType, Sequence[PromptType]],
                        sampling_params: ParamsArg = None) -> Iterator[StreamOutput]:
        """Yield (request_id, text delta, new token ids, finished) as tokens arrive, for one or many prompts."""
        ids = self._submit(prompts, sampling_params)
        sent: dict[tuple[str, int], tuple[int, int]] = {}     # (request, index) -> (chars, tokens) sent
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    for c in out.outputs:
                        chars, toks = sent.get((out.request_id, c.index), (0, 0))
                        if len(c.token_ids) == toks and c.finish_reason is None:
                            continue
                        sent[(out.request_id, c.index)] = (len(c.text), len(c.token_ids))
                        yield StreamOutput(out.request_id, c.text[chars:], c.token_ids[toks:],
                                           c.finish_reason is not None, c.index, c.finish_reason)
        finally:
            self.llm_engine.abort_request(ids)

    def chat(self, messages: Union[list[dict], list[list[dict]]], sampling_params: ParamsArg = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        from tokenmill.tokenizer import apply_chat_template
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it has no chat template; use generate() with token ids")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": apply_chat_template(tok, conv, add_generation_prompt)} for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
