"""Prefill and decode on separate instances (vLLM's disaggregated prefill, SGLang's PD disaggregation).

A prefill instance computes a prompt, then sends the KV of its full blocks to a decode instance, with each block's
hash and key: the same ones the prefix cache uses. The decode instance checks each block's digest and puts the
blocks into its host tier (kv_offload.py). When the request arrives there, the prefix cache finds them through that
tier and loads them instead of computing them; a block that did not arrive is computed, as on any miss.

The transfer runs over torch.distributed: one two-rank gloo group per prefill/decode pair, rendezvoused through a
TCPStore that the decode instance serves on kv_ip:kv_port. At connect the prefill instance sends what shapes its
cache's bytes, and the decode instance refuses a pairing that differs, naming the difference.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# vLLM's kv_role values, and the short names `--kv-role` takes
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
CONNECTORS = ("TorchDistributedConnector",)
DEFAULT_PORT = 14579
DECODE_HOST_GB = 1.0            # a receiving instance's host tier when kv_offload_memory_gb is not given
HELLO_S = 30.0          # how long a taken pairing slot waits for its hello
CONNECT_S = 10.0        # a sender's wait for a decode instance to answer its pairing
IDLE = datetime.timedelta(days=365)     # a decode instance's receive waits for the next transfer this long

Item = tuple[tuple[int, int], str, torch.Tensor]       # ((group, block hash), key text, payload)


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's --kv-transfer-config: kv_role (kv_producer: a prefill instance, kv_consumer: a decode instance,
    kv_both: either), the connector, and the address a receiving instance listens on. kv_connector_extra_config
    takes timeout_s (how long a sender waits on its peer, 60 s)."""
    kv_role: str
    kv_connector: str = CONNECTORS[0]
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_PORT
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        role = ROLES.get(self.kv_role, self.kv_role)
        if role not in ROLES.values():
            raise ValueError(f"unknown kv_role {self.kv_role!r}; choose one of prefill, decode, both (or vLLM's "
                             f"{', '.join(ROLES.values())})")
        object.__setattr__(self, "kv_role", role)
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"unknown kv_connector {self.kv_connector!r}; this engine has {', '.join(CONNECTORS)}")
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port must be a TCP port (1-65535), got {self.kv_port!r}")
        unknown = set(self.kv_connector_extra_config) - {"timeout_s"}
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}; it takes timeout_s")
        t = self.kv_connector_extra_config.get("timeout_s", 60)
        if not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(f"kv_connector_extra_config.timeout_s must be > 0 (seconds), got {t!r}")

    @staticmethod
    def of(value: Union["KVTransferConfig", dict, str, None], role: Optional[str] = None
           ) -> Optional["KVTransferConfig"]:
        """From LLMEngine's kv_transfer_config (a config, a dict or its JSON) and/or a kv_role; None: neither."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON ({e}); give an object such as "
                                 f'{{"kv_role": "kv_consumer", "kv_port": {DEFAULT_PORT}}}') from None
        if isinstance(value, KVTransferConfig):
            value = {f: getattr(value, f) for f in value.__dataclass_fields__}
        if value is None and role is None:
            return None
        value = dict(value or {})
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_config must be a JSON object")
        if role is not None:
            value["kv_role"] = role
        if "kv_role" not in value:
            raise ValueError("kv_transfer_config needs a kv_role (or give --kv-role prefill|decode|both)")
        try:
            return KVTransferConfig(**value)
        except TypeError as e:
            raise ValueError(f"kv_transfer_config: {e}; it takes kv_role, kv_connector, kv_ip, kv_port and "
                             f"kv_connector_extra_config") from None

    @property
    def sends(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def receives(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.kv_connector_extra_config.get("timeout_s", 60))

    def describe(self) -> str:
        name = {v: k for k, v in ROLES.items()}[self.kv_role]
        what = []
        if self.sends:
            what.append("sends prompts' KV to the decode instance each request names")
        if self.receives:
            what.append(f"receives KV on {self.kv_ip}:{self.kv_port}")
        return f"KV transfer: role {name} ({self.kv_role}), {'; '.join(what)}; over torch.distributed (gloo)"


class TransferStats:
    """Counters since start, from the transfer threads."""

    NAMES = ("blocks_sent", "bytes_sent", "blocks_received", "bytes_received", "blocks_refused", "failures")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(self.NAMES, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self.values[k] += v

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {f"kv_transfer_{k}": v for k, v in self.values.items()}


# the engine's counters of the transfer, cumulative (EngineStats, EngineState)
COUNTERS = tuple(TransferStats().counters())


def _one_thread() -> None:
    """A transfer thread computes on itself alone. A torch op that ran parallel here would start an OpenMP team of
    this thread's own, and with more OpenMP threads than cores, OpenMP stops spinning at its barriers: every later
    engine step slows down (BENCHMARKS.md, run qq)."""
    torch.set_num_threads(1)


def differences(theirs: dict, ours: dict) -> list[str]:
    """What differs between a prefill instance's cache identity and this one's, as readable lines."""
    ours = json.loads(json.dumps(ours, sort_keys=True, default=str))
    out = []
    for k in sorted(set(theirs) | set(ours)):
        if theirs.get(k) != ours.get(k):
            out.append(f"{k}: the prefill instance has {_short(theirs.get(k))}, this decode instance "
                       f"{_short(ours.get(k))}")
    return out


def _short(v: Any) -> str:
    s = json.dumps(v, default=str)
    return s if len(s) <= 160 else s[:157] + "..."


def _digest(p: torch.Tensor) -> str:
    return hashlib.blake2b(p.numpy().tobytes(), digest_size=16).hexdigest()


class KVReceiver:
    """A decode instance's side: serves the rendezvous on kv_ip:kv_port, pairs with each prefill instance that
    connects and matches (identity: what shapes this cache's bytes), and hands each transfer's good blocks to
    deliver (from a thread of the pair's own)."""

    def __init__(self, config: KVTransferConfig, identity: dict, nbytes: int, deliver: Callable[[list[Item]], None],
                 stats: TransferStats):
        self.config, self.identity, self.nbytes, self.deliver, self.stats = config, identity, nbytes, deliver, stats
        try:
            self.store = dist.TCPStore(config.kv_ip, config.kv_port, None, True, timeout=datetime.timedelta(seconds=5),
                                       wait_for_workers=False)
        except Exception as e:
            raise ValueError(f"the KV transfer cannot listen on {config.kv_ip}:{config.kv_port} ({e}); give another "
                             f"kv_port in kv_transfer_config") from None
        self._closed = False
        self._groups: list[Any] = []
        self._acceptor = threading.Thread(target=self._accept, name="tokenmill-kv-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        """Answer each prefill instance's hello, in whatever order they come. A slot whose hello never comes (its
        sender died between taking the slot and writing) is given up after HELLO_S instead of blocking the rest."""
        waiting: dict[int, float] = {}          # slots taken and not answered -> when first seen
        taken = 0
        while not self._closed:
            try:
                now = time.monotonic()
                n = self.store.add("clients", 0)
                for k in range(taken, n):
                    waiting[k] = now
                taken = max(taken, n)
                for k in sorted(waiting):
                    if self.store.check([f"hello/{k}"]):
                        del waiting[k]
                        self._answer(k)
                    elif now - waiting[k] > HELLO_S:
                        del waiting[k]
                        log.warning("KV transfer: prefill instance %d took a pairing slot and never said hello", k)
            except Exception as e:          # the rendezvous must outlive one bad exchange
                if not self._closed:
                    log.warning("KV transfer: answering a pairing failed (%s)", e)
            time.sleep(0.05)

    def _answer(self, k: int) -> None:
        try:
            diff = differences(json.loads(self.store.get(f"hello/{k}")), self.identity)
        except Exception as e:
            diff = [f"the prefill instance's hello cannot be read ({e})"]
        self.store.set(f"answer/{k}", json.dumps({"refused": diff}))
        if diff:
            log.warning("KV transfer: pairing %d refused: %s", k, "; ".join(diff))
        else:
            threading.Thread(target=self._serve, args=(k,), name=f"tokenmill-kv-recv{k}", daemon=True).start()

    def _serve(self, k: int) -> None:
        _one_thread()
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{k}", self.store), 0, 2, IDLE)
            # kept: a group destroyed on this thread while the process exits aborts the process
            self._groups.append(pg)
            log.info("KV transfer: paired with prefill instance %d", k)
            while not self._closed:
                self._receive(pg)
        except _Closed:
            log.info("KV transfer: prefill instance %d closed its pairing", k)
        except Exception as e:
            if not self._closed:
                self.stats.add(failures=1)
                log.warning("KV transfer: the pairing with prefill instance %d ended (%s)", k, e)

    def _receive(self, pg: Any) -> None:
        head = torch.zeros(3, dtype=torch.long)
        pg.recv([head], 1, 0).wait()
        n, nbytes, meta_len = head.tolist()
        if n < 0:           # the prefill instance closes the pairing
            raise _Closed
        meta = torch.empty(meta_len, dtype=torch.uint8)
        pg.recv([meta], 1, 0).wait()
        body = torch.empty(n, nbytes, dtype=torch.uint8)
        if n:
            pg.recv([body], 1, 0).wait()
        blocks = json.loads(meta.numpy().tobytes())
        good: list[Item] = []
        if nbytes == self.nbytes and len(blocks) == n:
            for (group, h, text, digest), payload in zip(blocks, body.unbind(0)):
                if _digest(payload) == digest:
                    good.append(((group, int(h, 16)), text, payload.clone()))
        refused = n - len(good)
        if refused:
            log.warning("KV transfer: %d of %d blocks refused (damaged, or not this cache's size); they will be "
                        "computed", refused, n)
        self.deliver(good)
        self.stats.add(blocks_received=len(good), bytes_received=len(good) * nbytes, blocks_refused=refused)
        pg.send([torch.tensor([len(good), refused])], 1, 0).wait()

    def close(self) -> None:
        """Stop accepting; the rendezvous store goes with the accepting thread (one left polling it while the
        process exits aborts the process)."""
        self._closed = True
        self._acceptor.join(timeout=5)
        self.store = None


class _Closed(Exception):
    pass


@dataclass
class _Pair:
    pg: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


class KVSender:
    """A prefill instance's side: pairs with decode instances (by their kv_ip:kv_port) and sends them blocks, one
    transfer at a time per pair, from a thread of its own."""

    def __init__(self, config: KVTransferConfig, identity: dict, stats: TransferStats):
        self.config, self.identity, self.stats = config, identity, stats
        self._pairs: dict[tuple[str, int], _Pair] = {}
        self._stores: list[Any] = []        # a pair's group uses its store: kept alive with it
        self._lock = threading.Lock()
        # the decode instances connect() paired (a router, through POST /v1/kv_transfer/connect): a request may
        # send its KV to these only, so that a client cannot make this instance connect elsewhere
        self.paired: set[tuple[str, int]] = set()
        # one sending thread per decode instance: a slow or dead one holds up only its own transfers
        self._senders: dict[tuple[str, int], concurrent.futures.ThreadPoolExecutor] = {}

    def connect(self, host: str, port: int) -> None:
        """Pair with the decode instance at host:port, afresh (it may have restarted since): ValueError if it
        refuses (naming the difference), ConnectionError if it cannot be reached. Requests may then send their KV
        there."""
        with self._lock:
            self._pairs.pop((host, port), None)
        self._pair(host, port)
        with self._lock:
            self.paired.add((host, port))

    def _pair(self, host: str, port: int) -> _Pair:
        with self._lock:
            pair = self._pairs.get((host, port))
            if pair is not None:
                return pair
            try:
                # a plain connect first: it fails at once where nothing listens (a TCPStore retries until its
                # timeout, logging each try)
                socket.create_connection((host, port), timeout=CONNECT_S).close()
                store = dist.TCPStore(host, port, None, False, timeout=min(self.config.timeout,
                                                                          datetime.timedelta(seconds=CONNECT_S)))
                k = store.add("clients", 1) - 1
                store.set(f"hello/{k}", json.dumps(self.identity, sort_keys=True, default=str))
                store.wait([f"answer/{k}"])
                refused = json.loads(store.get(f"answer/{k}"))["refused"]
            except Exception as e:
                raise ConnectionError(f"the decode instance's KV transfer at {host}:{port} cannot be reached ({e})"
                                      ) from None
            if refused:
                raise ValueError(f"the decode instance at {host}:{port} refuses the pairing: its cache differs from "
                                 f"this prefill instance's: " + "; ".join(refused))
            try:
                pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{k}", store), 1, 2, self.config.timeout)
            except Exception as e:
                raise ConnectionError(f"the decode instance at {host}:{port} accepted the pairing but its group "
                                      f"did not form ({e})") from None
            self._stores.append(store)
            pair = self._pairs[(host, port)] = _Pair(pg)
            return pair

    def send(self, host: str, port: int, items: list[Item]) -> dict[str, int]:
        """Send the blocks; what the decode instance accepted and refused. A pairing that fails is dropped (the
        next send pairs again) and the failure raised as ConnectionError."""
        pair = self._pair(host, port)
        nbytes = items[0][2].numel() if items else 0
        meta = json.dumps([[k[0], f"{k[1]:032x}", text, _digest(p)] for k, text, p in items]).encode()
        try:
            with pair.lock:
                pair.pg.send([torch.tensor([len(items), nbytes, len(meta)])], 0, 0).wait()
                pair.pg.send([torch.frombuffer(bytearray(meta), dtype=torch.uint8)], 0, 0).wait()
                if items:
                    pair.pg.send([torch.stack([p for _, _, p in items])], 0, 0).wait()
                ack = torch.zeros(2, dtype=torch.long)
                pair.pg.recv([ack], 0, 0).wait()
        except Exception as e:
            with self._lock:
                if self._pairs.get((host, port)) is pair:
                    del self._pairs[(host, port)]
            raise ConnectionError(f"sending KV to the decode instance at {host}:{port} failed ({e})") from None
        accepted, refused = ack.tolist()
        self.stats.add(blocks_sent=len(items), bytes_sent=len(items) * nbytes)
        return {"blocks": len(items), "bytes": len(items) * nbytes, "accepted": accepted, "refused": refused}

    def send_async(self, host: str, port: int, items: list[Item]) -> concurrent.futures.Future:
        """send() on that decode instance's sending thread; the future gives its result dict, or {"error": why}
        on a failure (or a destination connect() has not paired)."""
        def run() -> dict[str, Any]:
            try:
                if (host, port) not in self.paired:
                    raise ConnectionError(f"{host}:{port} is not a paired decode instance; a router pairs it "
                                          f"first (POST /v1/kv_transfer/connect)")
                return self.send(host, port, items)
            except Exception as e:          # whatever gloo raises: the reply says why, the decode side computes
                log.warning("KV transfer: %s", e)
                self.stats.add(failures=1)
                return {"error": str(e)}
        with self._lock:
            pool = self._senders.get((host, port))
            if pool is None:
                pool = self._senders[(host, port)] = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="tokenmill-kv-send", initializer=_one_thread)
        return pool.submit(run)

    def close(self) -> None:
        """Stop sending; the pairs close, so their decode instances see them end."""
        with self._lock:
            pools = list(self._senders.values())
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for pair in self._pairs.values():
                try:
                    with pair.lock:
                        pair.pg.send([torch.tensor([-1, 0, 0])], 0, 0).wait()
                except Exception:
                    pass
            self._pairs.clear()
            self._stores.clear()


def remote_decode(params: Optional[dict]) -> Optional[tuple[str, int]]:
    """The decode instance a request's kv_transfer_params ask its KV to be sent to (vLLM's do_remote_decode with
    remote_host and remote_port), or None; a ValueError saying what is missing."""
    if not params or not params.get("do_remote_decode"):
        return None
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        raise ValueError("kv_transfer_params with do_remote_decode need remote_host (a string) and remote_port "
                         "(an integer): the decode instance's kv_ip and kv_port")
    return host, port


class KVTransfer:
    """An instance's side of the transfer, as its role asks: a sender (prefill), a receiver (decode), or both.
    identity: what shapes this cache's bytes; codec: reads the blocks a sender sends; deliver takes the blocks a
    receiver accepts."""

    def __init__(self, config: KVTransferConfig, identity: dict, codec: Any,
                 deliver: Optional[Callable[[list[Item]], None]]):
        self.config, self.codec = config, codec
        nbytes = codec.nbytes
        self.stats = TransferStats()
        self.sender = KVSender(config, identity, self.stats) if config.sends else None
        self.receiver = None
        if config.receives:
            assert deliver is not None
            self.receiver = KVReceiver(config, identity, nbytes, deliver, self.stats)

    def info(self) -> dict[str, Any]:
        """What a router asks an instance (GET /kv_transfer)."""
        return {"kv_role": self.config.kv_role, "kv_connector": self.config.kv_connector,
                "kv_ip": self.config.kv_ip if self.receiver else None,
                "kv_port": self.config.kv_port if self.receiver else None}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
