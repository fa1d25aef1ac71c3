#!/usr/bin/env python3
"""Single-stream latency of vLLM (run with the vLLM venv's python): TTFT of a prompt, then decode tok/s.

  python peer_latency_vllm.py MODEL_DIR INPUT_LEN OUTPUT_LEN   -> one JSON line
TTFT is the median wall time of a max_tokens=1 request; decode tok/s is (OUTPUT_LEN - 1) over the extra time
a max_tokens=OUTPUT_LEN request takes beyond that.
"""
import json
import random
import statistics
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    model, n_in, n_out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    r = random.Random(0)
    prompt = {"prompt_token_ids": [r.randrange(100, 49052) for _ in range(n_in)]}
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096, enable_prefix_caching=False)

    def timed(max_tokens: int) -> float:
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate([prompt], p, use_tqdm=False)
        return time.perf_counter() - t

    timed(8)
    ttft = statistics.median(timed(1) for _ in range(3))
    full = timed(n_out)
    print(json.dumps({"engine": "vllm-cpu", "ttft_ms": 1000 * ttft, "decode_tok_s": (n_out - 1) / (full - ttft)}))


if __name__ == "__main__":
    main()
