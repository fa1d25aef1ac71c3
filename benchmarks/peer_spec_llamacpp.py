#!/usr/bin/env python3
"""Prompt-lookup decoding in llama.cpp through llama-cpp-python (run with its venv's python): one stream over
prompts given as token ids, greedy, without guesses (K = 0) or with LlamaPromptLookupDecoding guessing K tokens
from suffixes of up to MAX_NGRAM tokens (its defaults: 10 and 2).

  python peer_spec_llamacpp.py MODEL.gguf PROMPTS.json MAX_TOKENS THREADS K [MAX_NGRAM]   -> one JSON line

PROMPTS.json: {"prompts": [[token id, ...], ...], "stop": [token id, ...]}, the chat template already applied,
so that both engines read the same tokens. Decode tok/s is over each request's first to last token, as in
tokenmill's benchmark.
"""
import json
import sys
import time


def main() -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    path, prompts_path, max_tokens, threads, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5])
    max_ngram = int(sys.argv[6]) if len(sys.argv) > 6 else 2
    spec = json.load(open(prompts_path))
    draft = LlamaPromptLookupDecoding(max_ngram_size=max_ngram, num_pred_tokens=k) if k > 0 else None
    llm = Llama(model_path=path, n_ctx=4096, n_threads=threads, n_batch=512, verbose=False, draft_model=draft)
    stop = set(spec["stop"]) | {llm.token_eos()}
    tokens = 0
    seconds = 0.0
    for prompt in spec["prompts"]:
        first = last = None
        n = 0
        for tok in llm.generate(prompt, temp=0.0, reset=True):
            last = time.perf_counter()
            first = first or last
            n += 1
            if tok in stop or n == max_tokens:
                break
        tokens += n - 1
        seconds += last - first
    print(json.dumps({"engine": "llama.cpp", "decode_tok_s": tokens / seconds, "decode_tokens": tokens,
                      "num_pred_tokens": k, "max_ngram_size": max_ngram}))


if __name__ == "__main__":
    main()
