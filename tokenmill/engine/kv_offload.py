"""The prefix cache's tiers below the KV pool: host memory, then files on disk (vLLM's KV offloading, SGLang's
HiCache, llama.cpp's saved slots).

A cached block that the pool hands out for new tokens is copied out first (the engine does it before the step that
overwrites it) into a bounded host-memory tier; what that tier lets go goes to the disk tier, one file per block,
named by the block's hash under a directory named by everything that shapes the cache's bytes (the namespace). A
request's prefix is looked up past the pool's hit through the tiers; each block found is verified against the
request's own key (parent hash, token ids), and the run of found blocks is loaded into fresh pool blocks instead of
computed. A disk hit is promoted into host memory. At shutdown the pool's and host tier's cached blocks are written
to disk, so a restart with the same directory finds them.

A block's payload is one uint8 tensor: the rows of its slots in every per-slot cache tensor (codes, then per-token
scales), in the runner's order (BlockCodec).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

log = logging.getLogger(__name__)

MAGIC = b"TMKVBLK1"
TIERS = ("host", "disk")


@dataclass(frozen=True)
class KVOffloadConfig:
    """kv_offload_memory_gb: the host tier's bound (None: no host tier); kv_offload_dir: the disk tier's directory
    (None: no disk tier); kv_offload_disk_gb: the disk tier's bound (None: unbounded)."""
    memory_gb: Optional[float] = None
    directory: Optional[str] = None
    disk_gb: Optional[float] = None

    def __post_init__(self) -> None:
        for name, v in (("kv_offload_memory_gb", self.memory_gb), ("kv_offload_disk_gb", self.disk_gb)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 (GB), got {v}; leave it unset for no bound / no tier")
        if self.disk_gb is not None and self.directory is None:
            raise ValueError("kv_offload_disk_gb bounds the disk tier: set kv_offload_dir too")

    @property
    def enabled(self) -> bool:
        return self.memory_gb is not None or self.directory is not None

    def describe(self) -> str:
        parts = []
        if self.memory_gb is not None:
            parts.append(f"host {self.memory_gb:g} GB")
        if self.directory is not None:
            bound = f" {self.disk_gb:g} GB" if self.disk_gb is not None else ""
            parts.append(f"disk{bound} at {self.directory}")
        return ", ".join(parts) if parts else "off"


@dataclass
class OffloadStats:
    """Counters since start (vLLM counts an external tier's prefix hits in tokens; bytes are the payloads')."""
    queries: int = 0                 # tokens looked up past the pool's hit
    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))       # tokens, per tier
    bytes_loaded: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_stored: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    blocks_stored: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    corrupt_files: int = 0           # disk files skipped: unreadable, truncated, or not what their name says

    def counters(self) -> dict[str, int]:
        """As EngineStats' kv_offload_* counters (COUNTERS)."""
        out = {"kv_offload_queries": self.queries, "kv_offload_corrupt_files": self.corrupt_files}
        for tier in TIERS:
            out[f"kv_offload_hits_{tier}"] = self.hits[tier]
            out[f"kv_offload_bytes_loaded_{tier}"] = self.bytes_loaded[tier]
            out[f"kv_offload_bytes_stored_{tier}"] = self.bytes_stored[tier]
        return out


# the engine's counters of the tiers, cumulative (EngineStats, EngineState, bench's diffs)
COUNTERS = tuple(OffloadStats().counters())


class BlockCodec:
    """A block's slots in every per-slot cache tensor, to one uint8 payload and back. tensors: the runner's
    per-slot tensors ([slots, ...] each); block_size: slots per block. On a GPU the blocks of every tensor are
    gathered on the device into one buffer that crosses PCIe in one copy, to or from pinned host memory (a copy
    per layer from pageable memory ran at a twentieth of PCIe's pinned rate on the H100, run ss)."""

    def __init__(self, tensors: list[torch.Tensor], block_size: int):
        self.tensors, self.block_size = tensors, block_size
        self.sizes = [t[:block_size].numel() * t.element_size() for t in tensors]
        self.nbytes = sum(self.sizes)

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """t's bytes as [blocks, bytes of a block] (a runner may keep padding slots past the last block; bytes,
        since index_copy_ takes no fp8 dtype)."""
        n = t.shape[0] // self.block_size
        return t[:n * self.block_size].view(torch.uint8).view(n, -1)

    def read(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The payloads of these blocks, on the host (pinned, read off a GPU)."""
        dev = self.tensors[0].device
        ids = torch.tensor(block_ids, dtype=torch.long, device=dev)
        staged = torch.empty(len(block_ids), self.nbytes, dtype=torch.uint8, device=dev)
        off = 0
        for t, size in zip(self.tensors, self.sizes):
            torch.index_select(self._blocks(t), 0, ids, out=staged[:, off:off + size])
            off += size
        if dev.type == "cpu":
            return list(staged.unbind(0))
        host = torch.empty(staged.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(staged)                 # one transfer, waited for: the payloads are read as soon as returned
        return list(host.unbind(0))

    def write(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        """Payloads into these blocks' slots."""
        dev = self.tensors[0].device
        ids = torch.tensor(block_ids, dtype=torch.long, device=dev)
        host = torch.empty(len(payloads), self.nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        torch.stack(payloads, out=host)
        # one transfer; the scatters below follow it on the stream (the caching host allocator keeps the pinned
        # buffer until the copy is done)
        staged = host if dev.type == "cpu" else host.to(dev, non_blocking=True)
        off = 0
        for t, size in zip(self.tensors, self.sizes):
            self._blocks(t).index_copy_(0, ids, staged[:, off:off + size])
            off += size


Key = tuple[int, int]          # (group, block hash), as the pool's prefix-cache map


class HostTier:
    """Payloads in host memory, least recently used first out, at most capacity bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self.blocks: OrderedDict[Key, tuple[str, torch.Tensor]] = OrderedDict()     # key -> (key text, payload)

    def get(self, key: Key, text: str) -> Optional[torch.Tensor]:
        hit = self.blocks.get(key)
        if hit is None or hit[0] != text:
            return None
        self.blocks.move_to_end(key)
        return hit[1]

    def put(self, key: Key, text: str, payload: torch.Tensor) -> list[tuple[Key, str, torch.Tensor]]:
        """Keep it; returns what made room for it (oldest first)."""
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return []
        out = []
        while self.blocks and self.used + payload.numel() > self.capacity:
            k, (t, p) = self.blocks.popitem(last=False)
            self.used -= p.numel()
            out.append((k, t, p))
        if payload.numel() > self.capacity:
            return out + [(key, text, payload)]
        self.blocks[key] = (text, payload)
        self.used += payload.numel()
        return out


class DiskTier:
    """One file per block under directory/namespace/: a header (its key text, payload size and digest) and the
    payload. Written through a temporary file and a rename, so a reader never sees half a file; anything that does
    not check out is skipped, counted and removed."""

    def __init__(self, directory: str, namespace: str, nbytes: int, capacity: Optional[int], stats: OffloadStats):
        self.root = os.path.join(directory, namespace)
        try:
            os.makedirs(self.root, exist_ok=True)
            probe = os.path.join(self.root, f".probe-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"kv_offload_dir={directory!r} cannot be written ({e.strerror}); give a directory this "
                             f"process may create files in") from None
        self.nbytes, self.capacity, self.stats = nbytes, capacity, stats
        self.files: OrderedDict[str, int] = OrderedDict()        # file name -> its size, oldest first
        for name in sorted(os.listdir(self.root), key=lambda n: self._mtime(n)):
            if name.endswith(".kvb"):
                self.files[name] = self._size(name)
        self.used = sum(self.files.values())
        self._lock = threading.Lock()

    def _mtime(self, name: str) -> float:
        try:
            return os.stat(os.path.join(self.root, name)).st_mtime
        except OSError:
            return 0.0

    def _size(self, name: str) -> int:
        try:
            return os.stat(os.path.join(self.root, name)).st_size
        except OSError:
            return 0

    @staticmethod
    def name(key: Key) -> str:
        return f"{key[0]}-{key[1]:032x}.kvb"

    def has(self, key: Key) -> bool:
        return self.name(key) in self.files

    def get(self, key: Key, text: str) -> Optional[torch.Tensor]:
        name = self.name(key)
        path = os.path.join(self.root, name)
        # another engine on the same directory (a data-parallel replica) may have written it since the scan
        if name not in self.files and not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
            payload = self._parse(data, text)
        except FileNotFoundError:       # removed meanwhile (the bound, or another engine): a miss
            with self._lock:
                self.used -= self.files.pop(name, 0)
            return None
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            log.warning("KV offload: skipping %s (%s)", path, e)
            self.stats.corrupt_files += 1
            self._drop(name)
            return None
        if payload is None:        # another block under the same hash: not served, left in place
            return None
        with self._lock:
            if name in self.files:
                self.files.move_to_end(name)
            else:
                self.files[name] = len(data)
                self.used += len(data)
        return payload

    def _parse(self, data: bytes, text: str) -> Optional[torch.Tensor]:
        if data[:len(MAGIC)] != MAGIC:
            raise ValueError("not a KV block file")
        n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
        start = len(MAGIC) + 4
        header = json.loads(data[start:start + n].decode())
        body = data[start + n:]
        if len(body) != header["nbytes"] or header["nbytes"] != self.nbytes:
            raise ValueError(f"payload of {len(body)} bytes, expected {self.nbytes}")
        if hashlib.blake2b(body, digest_size=16).hexdigest() != header["digest"]:
            raise ValueError("payload digest mismatch")
        if header["key"] != text:
            return None
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)

    def put(self, key: Key, text: str, payload: torch.Tensor) -> int:
        """Write the block (bytes written; 0 if it is there already)."""
        name = self.name(key)
        if name in self.files:
            return 0
        body = payload.numpy().tobytes()
        header = json.dumps({"key": text, "nbytes": len(body),
                             "digest": hashlib.blake2b(body, digest_size=16).hexdigest()}).encode()
        path = os.path.join(self.root, name)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(4, "little") + header + body)
        os.replace(tmp, path)
        size = len(MAGIC) + 4 + len(header) + len(body)
        with self._lock:
            self.files[name] = size
            self.used += size
            while self.capacity is not None and self.used > self.capacity and len(self.files) > 1:
                old = next(iter(self.files))
                self._drop_locked(old)
        return size

    def _drop(self, name: str) -> None:
        with self._lock:
            self._drop_locked(name)

    def _drop_locked(self, name: str) -> None:
        size = self.files.pop(name, None)
        if size is None:
            return
        self.used -= size
        try:
            os.remove(os.path.join(self.root, name))
        except OSError:
            pass


def key_text(key: tuple) -> str:
    """What a tier stores to verify a block against a request's: its parent hash and token ids, and a digest of
    its extra keys (a cache salt may be a tenant's secret: never written out as it is)."""
    parent, tokens, extra = key
    tag = None if extra is None else hashlib.blake2b(repr(extra).encode(), digest_size=16).hexdigest()
    return repr((parent, tokens, tag))


class KVOffload:
    """The tiers, and the moves between them and the pool. Lives on the engine's thread; disk writes go to a
    writer thread, and a block queued for writing is found in the queue until it is written."""

    def __init__(self, config: KVOffloadConfig, codec: BlockCodec, namespace: str):
        self.config, self.codec, self.namespace = config, codec, namespace
        self.stats = OffloadStats()
        self.host = None if config.memory_gb is None else HostTier(int(config.memory_gb * 2 ** 30))
        self.disk = None
        if config.directory is not None:
            cap = None if config.disk_gb is None else int(config.disk_gb * 2 ** 30)
            self.disk = DiskTier(config.directory, namespace, codec.nbytes, cap, self.stats)
        self._queue: OrderedDict[Key, tuple[str, torch.Tensor]] = OrderedDict()     # waiting for the writer
        self._cond = threading.Condition()
        self._closed = False
        self._writer = None
        # blocks a KV transfer received (its thread), stored at the next lookup (the engine's thread)
        self._inbox: list[tuple[Key, str, torch.Tensor]] = []
        self._inbox_lock = threading.Lock()
        if self.disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="tokenmill-kv-disk", daemon=True)
            self._writer.start()

    # ---- lookups (the scheduler) ------------------------------------------------------------------------------
    def find(self, group: int, h: int, key: tuple, evicted: list[tuple[int, Key, tuple]] = ()
             ) -> Optional[tuple[str, Union[torch.Tensor, Key]]]:
        """(tier, payload) of a block (its group, hash and key) that a tier holds, or None. evicted: the pool's
        evictions not yet saved (this very schedule's); a block among them is found as its key, its payload to come
        from save() before the step runs."""
        if self._inbox:
            self._take_received()
        k = (group, h)
        hit = self._find(k, key_text(key))
        if hit is None and any(bk == k and bkey == key for _, bk, bkey in evicted):
            hit = ("host" if self.host is not None else "disk", k)
        return hit

    def receive(self, items: list[tuple[Key, str, torch.Tensor]]) -> None:
        """Blocks another instance computed ((group, hash), key text, payload), from a KV transfer's thread."""
        with self._inbox_lock:
            self._inbox.extend(items)

    def _take_received(self) -> None:
        with self._inbox_lock:
            items, self._inbox = self._inbox, []
        for k, text, p in items:
            self.store(k, text, p)

    def _find(self, k: Key, text: str) -> Optional[tuple[str, torch.Tensor]]:
        if self.host is not None:
            p = self.host.get(k, text)
            if p is not None:
                return "host", p
        if self.disk is None:
            return None
        with self._cond:
            queued = self._queue.get(k)
        if queued is not None and queued[0] == text:      # on its way to disk, still in memory
            return "disk", queued[1]
        p = self.disk.get(k, text)
        if p is None:
            return None
        if self.host is not None:          # promoted: the next hit on it is a memory copy
            self._spill(self.host.put(k, text, p))
        return "disk", p

    def count(self, queried_tokens: int, loads: list[tuple[int, int, tuple[str, object]]], full_group: int,
              block_size: int) -> None:
        """A lookup whose blocks were taken (loads: (group, block index, (tier, payload)) each); its tokens are the
        full-attention group's blocks (a hybrid cache's window groups load blocks of the same tokens)."""
        self.stats.queries += queried_tokens
        for group, _, (tier, _) in loads:
            self.stats.hits[tier] += block_size if group == full_group else 0
            self.stats.bytes_loaded[tier] += self.codec.nbytes

    # ---- stores (the engine, before a step overwrites what the pool evicted) ------------------------------------
    def save(self, evicted: list[tuple[int, Key, tuple]]) -> dict[Key, torch.Tensor]:
        """The pool's evicted blocks (block id, key, block key), read from the cache before they are overwritten;
        returns their payloads by key."""
        if not evicted:
            return {}
        payloads = self.codec.read([bid for bid, _, _ in evicted])
        for (_, k, key), p in zip(evicted, payloads):
            self.store(k, key_text(key), p)
        return {k: p for (_, k, _), p in zip(evicted, payloads)}

    def store(self, k: Key, text: str, payload: torch.Tensor) -> None:
        if self.host is not None:
            if k not in self.host.blocks:        # (a block loaded from it and evicted again is there already)
                self.stats.bytes_stored["host"] += payload.numel()
                self.stats.blocks_stored["host"] += 1
            self._spill(self.host.put(k, text, payload))
        else:
            self._spill([(k, text, payload)])

    def _spill(self, out: list[tuple[Key, str, torch.Tensor]]) -> None:
        if self.disk is None or not out:
            return
        with self._cond:
            for k, text, p in out:
                if not self.disk.has(k):
                    self._queue[k] = (text, p)
            self._cond.notify()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                k, (text, p) = next(iter(self._queue.items()))
            try:
                n = self.disk.put(k, text, p)
                if n:
                    self.stats.bytes_stored["disk"] += p.numel()
                    self.stats.blocks_stored["disk"] += 1
            except OSError as e:
                log.warning("KV offload: could not write a block to %s (%s)", self.disk.root, e)
            with self._cond:
                self._queue.pop(k, None)
                self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        with self._cond:
            while self._queue:
                self._cond.wait(timeout=1.0)

    def close(self, pool_blocks: Callable[[], list[tuple[int, Key, tuple]]]) -> None:
        """At shutdown: the pool's and host tier's cached blocks go to disk (pool_blocks: the pool's cached blocks
        as (block id, key, block key)), then the writer stops."""
        if self.disk is None or self._closed:
            return
        blocks = pool_blocks()
        for i in range(0, len(blocks), 64):
            chunk = blocks[i:i + 64]
            for (_, k, key), p in zip(chunk, self.codec.read([b for b, _, _ in chunk])):
                self._spill([(k, key_text(key), p)])
        if self.host is not None:
            self._spill([(k, t, p) for k, (t, p) in self.host.blocks.items()])
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=30)

    # ---- what an operator sees --------------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        """Bytes held per tier now."""
        return {"host": self.host.used if self.host is not None else 0,
                "disk": self.disk.used if self.disk is not None else 0}


def disk_tier_lines(directory: str) -> list[str]:
    """What a disk tier's directory holds, for `tokenmill info`: each cache's blocks and bytes."""
    if not os.path.isdir(directory):
        return [f"KV offload disk tier {directory}: no such directory"]
    out = [f"KV offload disk tier {directory}:"]
    for ns in sorted(os.listdir(directory)):
        root = os.path.join(directory, ns)
        if not os.path.isdir(root):
            continue
        sizes = [os.path.getsize(os.path.join(root, n)) for n in os.listdir(root) if n.endswith(".kvb")]
        out.append(f"  cache {ns}: {len(sizes):,} blocks, {sum(sizes) / 2 ** 20:,.1f} MiB")
    if len(out) == 1:
        out.append("  empty")
    return out


def namespace_of(parts: dict) -> str:
    """The directory name for a cache: a digest of everything that shapes its bytes (the model's config and
    weights' files, dtypes, the kernels, the cache's layout). Another model, dtype or layout gets another one."""
    return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()
