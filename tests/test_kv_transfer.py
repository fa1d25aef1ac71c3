"""Prefill and decode on separate instances (engine/kv_transfer.py): a prompt prefilled on one engine and decoded on
another, its KV sent over torch.distributed (gloo), gives the tokens and logprobs of one engine and of transformers;
every block either arrives or is refused and computed; a pairing of different caches is refused, naming the
difference."""
from __future__ import annotations

import random

import pytest

from tests.tiny_models import build_tiny, hf_greedy
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.kv_transfer import KVTransferConfig, remote_decode
from tokenmill.executor.parallel import free_port
from tokenmill.sampling_params import SamplingParams

BS = 16


class _Models(dict):
    """Tiny models by kind, each built when a test first asks for it."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, kind: str):
        self[kind] = build_tiny(kind, self.factory.mktemp(kind))
        return self[kind]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory)


def _engine(path: str, role=None, port=None, **kw) -> LLMEngine:
    cfg = None if role is None else {"kv_role": role, **({"kv_port": port} if port else {})}
    kw.setdefault("kv_cache_memory_gb", 0.005)
    return LLMEngine(path, dtype="float32", max_model_len=256, kv_transfer_config=cfg, **kw)


def _drain(eng: LLMEngine) -> dict:
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    return outs


def _workload(seed: int = 0) -> list[tuple[str, list[int], SamplingParams, dict]]:
    """Prompts shorter than a block, a block and one token, exact blocks, long ones; greedy with logprobs, seeded
    sampling with n=2, a cache salt; the even ones sent through a prefill instance, the odd ones not."""
    r = random.Random(seed)
    lengths = [5, 17, 32, 33, 48, 95, 130, 61]
    out = []
    for i, n in enumerate(lengths):
        ids = [r.randrange(5, 250) for _ in range(n)]
        if i % 3 == 2:
            params = SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=7, ignore_eos=True, logprobs=2)
        else:
            params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2)
        prompt = {"prompt_token_ids": ids, **({"cache_salt": "tenant-a"} if i == 3 else {})}
        out.append((f"r{i}", prompt, params, {"transfer": i % 2 == 0 or i == 5}))
    return out


def _results(outs: dict) -> dict:
    return {rid: [(c.token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in c.logprobs])
                  for c in o.outputs] for rid, o in outs.items()}


def _disaggregated(pre: LLMEngine, dec: LLMEngine, port: int, work) -> tuple[dict, dict]:
    """Each request's prefill leg on pre (one token, its KV sent to dec), then the request on dec."""
    kvp = {"do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": port}
    for rid, prompt, params, how in work:
        if how["transfer"]:
            leg = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": kvp})
            pre.add_request(rid, prompt, leg)
    sent = {rid: o.kv_transfer_params["transfer"].result(timeout=60) for rid, o in _drain(pre).items()}
    for rid, prompt, params, _ in work:
        dec.add_request(rid, prompt, params)
    return _results(_drain(dec)), sent


@pytest.mark.parametrize("kind", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_disaggregated_equals_one_instance_and_transformers(models, kind):
    """A mixed workload, decoded under chunked prefill (24-token budget): tokens equal one engine's and, greedy,
    transformers'; logprobs within 1e-5 of one engine's; the decode instance computes only each transferred
    prompt's last block."""
    path, hf = models[kind]
    port = free_port()
    dec = _engine(path, "decode", port, max_num_batched_tokens=24)
    pre = _engine(path, "prefill")
    pre.transfer.sender.connect("127.0.0.1", port)
    one = _engine(path, max_num_batched_tokens=24)
    work = _workload()
    got, sent = _disaggregated(pre, dec, port, work)
    for rid, prompt, params, _ in work:
        one.add_request(rid, prompt, params)
    base = _results(_drain(one))
    assert [[t for t, _ in got[r]] for r, *_ in work] == [[t for t, _ in base[r]] for r, *_ in work]
    assert max(abs(x[1] - y[1]) for r, *_ in work for (_, la), (_, lb) in zip(got[r], base[r])
               for ra, rb in zip(la, lb) for x, y in zip(ra, rb)) < 1e-5
    for rid, prompt, params, _ in work:
        if params.temperature == 0:
            ids = prompt["prompt_token_ids"]
            assert got[rid][0][0] == hf_greedy(hf, ids, 7), rid
    # what was sent: every full block but the one holding the last prompt token, in each KV group
    groups = dec.kv.num_groups
    for rid, prompt, _, how in work:
        if how["transfer"]:
            n = (len(prompt["prompt_token_ids"]) - 1) // BS
            assert sent[rid]["accepted"] == sent[rid]["blocks"] and sent[rid]["refused"] == 0
            assert sent[rid]["blocks"] >= n and (groups > 1 or sent[rid]["blocks"] == n), (rid, sent[rid])
    found = sum((len(p["prompt_token_ids"]) - 1) // BS * BS for _, p, _, how in work if how["transfer"])
    assert dec.stats.kv_offload_hits_host == found > 0
    c = dec.transfer.stats.counters()
    assert c["kv_transfer_blocks_received"] == sum(s["blocks"] for s in sent.values())
    assert c["kv_transfer_blocks_refused"] == 0 and c["kv_transfer_failures"] == 0
    assert pre.transfer.stats.counters()["kv_transfer_bytes_sent"] == sum(s["bytes"] for s in sent.values())
    for e in (pre, dec, one):
        e.shutdown()


DECODE_CHILD = """
import sys, time
from tokenmill.engine.engine import LLMEngine
engine = LLMEngine(sys.argv[1], dtype="float32", max_model_len=256, kv_cache_memory_gb=0.005,
                   kv_transfer_config={"kv_role": "decode", "kv_port": int(sys.argv[2])})
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_failed_transfer_is_computed_on_the_decode_instance(models):
    """The decode instance dies after pairing: the prefill leg says why, the failure is counted, and the request
    decoded on another instance gives transformers' tokens. A destination never paired is refused up front."""
    import subprocess
    import sys
    path, hf = models["llama"]
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", DECODE_CHILD, path, str(port)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        pre = _engine(path, "prefill")
        pre.transfer.sender.connect("127.0.0.1", port)
    finally:
        child.kill()
        child.wait()
    dec = _engine(path, "decode", free_port())
    work = [w for w in _workload(1) if w[2].temperature == 0][:2]
    got, sent = _disaggregated(pre, dec, port, [(r, p, s, {"transfer": True}) for r, p, s, _ in work])
    assert all("failed" in s["error"] or "cannot be reached" in s["error"] for s in sent.values()), sent
    assert pre.transfer.stats.counters()["kv_transfer_failures"] == 2
    assert dec.stats.kv_offload_hits_host == 0
    for rid, prompt, _, _ in work:
        assert got[rid][0][0] == hf_greedy(hf, prompt["prompt_token_ids"], 7)
    other = free_port()
    with pytest.raises(ValueError, match=f"names 127.0.0.1:{other}, which this prefill instance has not paired"):
        pre.add_request("x", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(extra_args={"kv_transfer_params": {
            "do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": other}}))
    pre.shutdown()
    dec.shutdown()


def test_blocks_of_another_size_or_key_are_never_served(models):
    """Blocks of another cache's size are refused and counted; blocks sent under a block's hash with another key
    are kept but never served: the request computes its prompt and gives transformers' tokens."""
    path, hf = models["llama"]
    port = free_port()
    dec = _engine(path, "decode", port)
    pre = _engine(path, "prefill")
    ids = random.Random(3).choices(range(5, 250), k=70)
    # the real blocks, read from a prefill
    pre.add_request("a", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    _drain(pre)
    blocks = [(bid, pre.kv.pool.blocks[bid]) for bid in range(pre.kv.num_blocks)
              if pre.kv.pool.blocks[bid].block_hash is not None]
    payloads = pre.transfer.codec.read([b for b, _ in blocks])
    sender = pre.transfer.sender
    short = [(blk.block_hash, "x", p[:-4]) for (_, blk), p in zip(blocks, payloads)]
    assert sender.send("127.0.0.1", port, short) == {"blocks": len(short), "bytes": len(short) * (payloads[0].numel() - 4),
                                                      "accepted": 0, "refused": len(short)}
    wrong = [(blk.block_hash, repr((None, (1, 2, 3), None)), p) for (_, blk), p in zip(blocks, payloads)]
    assert sender.send("127.0.0.1", port, wrong)["accepted"] == len(wrong)
    dec.add_request("b", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    out = _drain(dec)["b"]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 7)
    assert out.num_cached_tokens == 0 and dec.stats.kv_offload_hits_host == 0
    assert dec.transfer.stats.counters()["kv_transfer_blocks_refused"] == len(short)
    pre.shutdown()
    dec.shutdown()


def test_a_pairing_of_different_caches_is_refused(models):
    """A prefill instance of another dtype (or model) is refused at connect, the difference named."""
    path, _ = models["llama"]
    port = free_port()
    dec = _engine(path, "decode", port)
    pre = LLMEngine(path, dtype="bfloat16", max_model_len=256, kv_cache_memory_gb=0.005,
                    kv_transfer_config='{"kv_role": "kv_producer"}')
    with pytest.raises(ValueError, match=r"refuses the pairing.*dtype: the prefill instance has \"torch.bfloat16\""):
        pre.transfer.sender.connect("127.0.0.1", port)
    other, _ = models["gemma2"]
    pre2 = _engine(other, "prefill")
    with pytest.raises(ValueError, match="refuses the pairing.*model: "):
        pre2.transfer.sender.connect("127.0.0.1", port)
    for e in (pre, pre2, dec):
        e.shutdown()


def test_bad_settings_are_refused(models):
    path, _ = models["llama"]
    for cfg, msg in [({"kv_role": "middle"}, "unknown kv_role 'middle'; choose one of prefill, decode, both"),
                     ({"kv_role": "decode", "kv_connector": "NixlConnector"}, "unknown kv_connector 'NixlConnector'"),
                     ({"kv_role": "decode", "kv_port": 70000}, "kv_port must be a TCP port"),
                     ({"kv_port": 1234}, "needs a kv_role"),
                     ({"kv_role": "decode", "kv_connector_extra_config": {"x": 1}}, "unknown keys \\['x'\\]"),
                     ("{not json", "not valid JSON")]:
        with pytest.raises(ValueError, match=msg):
            KVTransferConfig.of(cfg)
    assert KVTransferConfig.of(None, "prefill").kv_role == "kv_producer"
    assert KVTransferConfig.of('{"kv_role": "kv_consumer"}', "both").kv_role == "kv_both"
    with pytest.raises(ValueError, match="prefix cache, which is off here"):
        _engine(path, "decode", free_port(), enable_prefix_caching=False)
    port = free_port()
    dec = _engine(path, "decode", port)
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
        _engine(path, "decode", port)
    with pytest.raises(ValueError, match="this instance sends no KV; start it with kv_role prefill or both"):
        dec.add_request("x", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(extra_args={"kv_transfer_params": {
            "do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": port}}))
    with pytest.raises(ValueError, match="need remote_host"):
        remote_decode({"do_remote_decode": True, "remote_port": "9"})
    from tokenmill.engine.data_parallel import DataParallelLLM
    with pytest.raises(ValueError, match="pair them with `tokenmill router`"):
        DataParallelLLM(path, 2, kv_transfer_config={"kv_role": "prefill"})
    dec.shutdown()


def test_router_asks_its_clients_for_the_instances_key():
    """With --api-key, the router wants it of its clients (401 in OpenAI's shape) and a request that has it goes on
    to the instances (here: none is up, a 503 naming the decode instance)."""
    from fastapi.testclient import TestClient

    from tokenmill.server.disagg import DisaggRouter, build_router_app
    dead = f"http://127.0.0.1:{free_port()}"
    router = DisaggRouter([dead], [dead], api_key="k1")
    router.decode[0].error = "refused"
    with TestClient(build_router_app(router)) as client:
        body = {"model": "m", "prompt": "hi"}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k1"})
        assert r.status_code == 503 and f"decode instance {dead} is down" in r.json()["error"]["message"]
        assert client.get("/v1/models").status_code == 401
        h = client.get("/health")
        assert h.status_code == 503 and f"decode instance {dead} is down: refused" in h.json()["error"]["message"]
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        DisaggRouter([], [dead])


def test_router_tries_another_decode_instance(models):
    """A decode instance that cannot be reached is marked down and the request goes to the next one; with none
    left, a 503 names each."""
    from fastapi.testclient import TestClient

    from tokenmill.server.disagg import DisaggRouter, build_router_app
    dead1, dead2 = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    router = DisaggRouter([dead1], [dead1, dead2])
    router.prefill[0].error = "down"
    for d in router.decode:
        d.kv = ("127.0.0.1", 1)
    with TestClient(build_router_app(router)) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        msg = r.json()["error"]["message"]
        assert r.status_code == 503 and f"decode instance {dead1} is down: cannot be reached" in msg \
            and f"decode instance {dead2} is down: cannot be reached" in msg, msg
        assert router.pick_decode.load == [0, 0]
