"""Prefill and decode on separate `tokenmill serve` processes behind `tokenmill router`, on loopback: the real
`openai` client gets one instance's tokens (and transformers' greedy ones), streamed and not; a killed prefill
instance leaves the decode instance serving, /health names it (503) until it is back and paired again; a prefill
instance with another dtype is refused at the router's start, the difference named."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixtures import build_chat_model, wait_started
from tokenmill.executor.parallel import free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
MODEL = "tiny-chat"


class Proc:
    """A tokenmill command in a subprocess, its output collected; url: what it printed as its address."""

    def __init__(self, *args: str):
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self.url = ""

    def wait_ready(self, marker: str, timeout: float = 180) -> "Proc":
        self.url = wait_started(self.proc, marker, self.log, timeout)
        return self

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def serve(model: str, port: int, *args: str) -> Proc:
    return Proc("serve", model, "--port", str(port), "--dtype", "float32", "--device", "cpu", "--max-model-len",
                "512", "--kv-cache-memory-gb", "0.05", "--served-model-name", MODEL, "--threads", "1", *args)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_chat_model(str(tmp_path_factory.mktemp("disagg-chat")))


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


TEXT = "The history of the printing press begins in the workshops of the Rhine, where " * 3
REQUESTS = [
    ("completion", dict(prompt=TEXT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})),
    ("completion", dict(prompt="Hi", max_tokens=8, temperature=0)),                  # shorter than a block
    ("completion", dict(prompt=TEXT[:150], max_tokens=10, temperature=0.9, seed=7, n=2)),
    ("completion", dict(prompt=TEXT, max_tokens=8, temperature=0, extra_body={"cache_salt": "tenant-a"})),
    ("chat", dict(messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": TEXT}],
                  max_tokens=12, temperature=0)),
]


def _ask(url: str, kind: str, kw: dict, stream: bool, salt: Optional[str] = None) -> list[str]:
    """The reply's texts. salt: a cache_salt of its own, so that the request finds no block another one left."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    if salt is not None:
        kw = {**kw, "extra_body": {**kw.get("extra_body", {}), "cache_salt": salt}}
    if kind == "chat":
        if stream:
            return ["".join(ch.choices[0].delta.content or "" for ch in
                            c.chat.completions.create(model=MODEL, stream=True, **kw) if ch.choices)]
        return [ch.message.content for ch in c.chat.completions.create(model=MODEL, **kw).choices]
    if stream:
        texts: dict[int, str] = {}
        for ch in c.completions.create(model=MODEL, stream=True, **kw):
            for choice in ch.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        return [texts[i] for i in sorted(texts)]
    return [ch.text for ch in c.completions.create(model=MODEL, **kw).choices]


def _workload(url: str, alone: bool = False) -> list[list[str]]:
    """alone: each request under a salt of its own, so the instance computes every prompt itself."""
    return [_ask(url, kind, kw, stream, f"alone-{i}-{stream}" if alone else None)
            for stream in (False, True) for i, (kind, kw) in enumerate(REQUESTS)]


def test_router_over_prefill_and_decode_instances(model_dir):
    kv_port, p_port = free_port(), free_port()
    procs: list[Proc] = []
    try:
        dec = serve(model_dir, 0, "--kv-role", "decode", "--kv-transfer-config", f'{{"kv_port": {kv_port}}}')
        pre = serve(model_dir, p_port, "--kv-role", "prefill")
        procs += [dec, pre]
        for p in (dec, pre):
            p.wait_ready("OpenAI API:")
        assert any(f"KV transfer: role decode (kv_consumer), receives KV on 127.0.0.1:{kv_port}" in line
                   for line in dec.log)
        router = Proc("router", "--port", "0", "--prefill", pre.url, "--decode", dec.url)
        procs.append(router)
        router.wait_ready("router on")

        # a mixed workload: one instance's replies (the decode instance's own, each computing its prompt), streamed
        # and not; greedy ones are transformers' tokens
        expected = _workload(dec.url, alone=True)
        assert _workload(router.url) == expected
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": TEXT, "max_tokens": 12,
                                                             "temperature": 0, "return_token_ids": True}).json()
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = r["choices"][0]["prompt_token_ids"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        eos = hf.config.eos_token_id
        got = r["choices"][0]["token_ids"]
        assert got == ref[:len(got)] and (len(got) == 12 or ref[len(got)] == eos)
        m = _metrics(router.url)
        n = 2 * len(REQUESTS) + 1 - 2          # "Hi" fits in its block: nothing to send, stream or not
        assert m[("tokenmill:kv_transfer_requests_total", (("outcome", "transferred"),))] == n
        assert m[("tokenmill:kv_transfer_fallbacks_total", (("reason", "prompt within one block"),))] == 2
        d = _metrics(dec.url)
        received = d[("tokenmill:kv_transfer_blocks_total", (("direction", "received"), ("model_name", MODEL)))]
        assert received > 0
        assert d[("tokenmill:kv_offload_hits_total", (("model_name", MODEL), ("tier", "host")))] > 0
        assert d.get(("tokenmill:kv_transfer_blocks_total", (("direction", "refused"), ("model_name", MODEL)))) == 0

        # the prefill instance is killed: the decode instance serves on (computing prompts), /health names it
        pre.proc.send_signal(signal.SIGKILL)
        pre.proc.wait(timeout=10)
        # (a salt of their own: the decode instance computes these prompts, finding none it has cached)
        again = [_ask(router.url, kind, kw, False, f"after-kill-{i}") for i, (kind, kw) in enumerate(REQUESTS)]
        assert again == expected[:len(REQUESTS)]
        h = httpx.get(router.url + "/health")
        assert h.status_code == 503 and f"prefill instance {pre.url} is down" in h.json()["error"]["message"]
        m = _metrics(router.url)
        assert m[("tokenmill:kv_transfer_requests_total", (("outcome", "fallback"),))] == 2 + len(REQUESTS)

        # it comes back on its port: paired again, the router healthy, transfers resume (and, for the last part,
        # a prefill instance whose cache differs starts beside it)
        pre2 = serve(model_dir, p_port, "--kv-role", "prefill")
        odd = serve(model_dir, 0, "--kv-role", "prefill", "--dtype", "bfloat16")
        procs += [pre2, odd]
        pre2.wait_ready("OpenAI API:")
        deadline = time.monotonic() + 30
        while httpx.get(router.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "".join(router.log)
            time.sleep(0.2)
        assert _ask(router.url, *REQUESTS[0], False) == expected[0]
        m = _metrics(router.url)
        assert m[("tokenmill:kv_transfer_requests_total", (("outcome", "transferred"),))] == n + 1

        # a prefill instance whose cache differs (bfloat16) is refused when the router pairs it, and a router given
        # an instance of the wrong role says which
        odd.wait_ready("OpenAI API:")
        routers = [subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "router", "--port", "0", "--prefill",
                                     first, "--decode", dec.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for first in (odd.url, dec.url)]
        (_, bad), (_, wrong) = [r.communicate(timeout=120) for r in routers]
        assert [r.returncode for r in routers] == [2, 2]
        assert "refuses the pairing" in bad and 'dtype: the prefill instance has "torch.bfloat16"' in bad, bad
        assert "its KV role is kv_consumer; start it with --kv-role prefill" in wrong, wrong
        # paired instances stop as any server does: SIGTERM, exit 0
        for p in (pre2, dec):
            p.proc.send_signal(signal.SIGTERM)
            assert p.proc.wait(timeout=60) == 0, "".join(p.log)
    finally:
        for p in procs:
            p.close()
