"""What a step sends between host and device: the values decided on the host, gathered in one buffer and moved in
one copy (HostBuffer), and one result brought back in one copy without blocking until it is read (Download)."""
from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class BufferRef:
    """A run of values in a HostBuffer: kind "i" int64, "f" float32, "w" int32 words; n values, viewed as shape."""
    kind: str
    off: int
    n: int
    shape: tuple[int, ...]


class HostBuffer:
    """Everything a step takes from the host, gathered from the Python params (never read back from the device) into
    one int64 buffer: int64 values, then float32 values and int32 words (grammar bitmasks) through dtype views of the
    same memory. upload() sends it to the device in one copy: from pinned memory without blocking on CUDA; on CPU the
    buffer is used where it is. Device tensors are views into the uploaded buffer (get)."""

    def __init__(self) -> None:
        self._ints: list[int] = []
        self._floats: list[float] = []
        self._words: list[torch.Tensor] = []      # int32 host tensors, flattened in order
        self._num_words = 0
        self._dev: Optional[torch.Tensor] = None
        self._host: Optional[torch.Tensor] = None
        self._float_at = self._words_at = 0
        self._device = torch.device("cpu")

    def ints(self, values: Sequence[int], shape: Optional[tuple[int, ...]] = None) -> BufferRef:
        ref = BufferRef("i", len(self._ints), len(values), shape or (len(values),))
        self._ints.extend(values)
        return ref

    def floats(self, values: Sequence[float], shape: Optional[tuple[int, ...]] = None) -> BufferRef:
        ref = BufferRef("f", len(self._floats), len(values), shape or (len(values),))
        self._floats.extend(values)
        return ref

    def words(self, rows: Sequence[torch.Tensor]) -> BufferRef:
        """int32 host tensors of one width (packed bitmask rows), as one [len(rows), width] int32 device tensor."""
        width = rows[0].numel()
        ref = BufferRef("w", self._num_words, len(rows) * width, (len(rows), width))
        for t in rows:
            if t.numel() != width:
                raise ValueError(f"token bitmasks of different widths: {width} and {t.numel()} words")
            self._words.append(t.reshape(-1))
        self._num_words += ref.n
        return ref

    def upload(self, device: torch.device) -> "HostBuffer":
        """Fill the host buffer and start its one copy to `device`."""
        n_i, n_f, n_w = len(self._ints), len(self._floats), self._num_words
        self._float_at = 2 * n_i                   # in 4-byte slots
        self._words_at = self._float_at + n_f
        size = n_i + (n_f + n_w + 1) // 2
        self._device = device
        if size == 0:
            return self
        cuda = device.type == "cuda"
        buf = torch.empty(size, dtype=torch.int64, pin_memory=cuda)
        # the Python values as C arrays (float32 rounding as torch's), straight into the buffer
        if n_i:
            buf[:n_i] = torch.frombuffer(array.array("q", self._ints), dtype=torch.int64)
        if n_f:
            buf.view(torch.float32)[self._float_at:self._words_at] = torch.frombuffer(
                array.array("f", self._floats), dtype=torch.float32)
        if n_w:
            words = buf.view(torch.int32)[self._words_at:self._words_at + n_w]
            at = 0
            for t in self._words:
                words[at:at + t.numel()] = t      # a host tensor (a device one would be a copy that waits)
                at += t.numel()
        self._host = buf                          # kept: the pinned memory must outlive the copy
        self._dev = buf if device.type == "cpu" else buf.to(device, non_blocking=cuda)
        return self

    def get(self, ref: Optional[BufferRef]) -> Optional[torch.Tensor]:
        if ref is None:
            return None
        if self._dev is None:                     # an empty buffer: only empty runs
            dtype = {"i": torch.int64, "f": torch.float32, "w": torch.int32}[ref.kind]
            return torch.empty(ref.shape, dtype=dtype, device=self._device)
        if ref.kind == "i":
            flat = self._dev[ref.off:ref.off + ref.n]
        elif ref.kind == "f":
            flat = self._dev.view(torch.float32)[self._float_at + ref.off:self._float_at + ref.off + ref.n]
        else:
            flat = self._dev.view(torch.int32)[self._words_at + ref.off:self._words_at + ref.off + ref.n]
        return flat.view(ref.shape)


class Download:
    """One device-to-host copy of a result tensor: on CUDA into pinned memory without blocking, with an event that
    wait() waits on; on CPU the tensor itself."""

    def __init__(self, t: torch.Tensor):
        self._event = None
        self._src: Optional[torch.Tensor] = None
        if t.device.type == "cuda":
            with torch.cuda.device(t.device):
                self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self._host.copy_(t, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
        elif t.device.type == "cpu":
            self._host = t
        else:                                     # another accelerator: a plain copy when the result is read
            self._host, self._src = None, t

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        elif self._host is None:
            self._host = self._src.cpu()
        return self._host


def to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Python values as a tensor on device, without the host waiting: pinned and copied asynchronously on CUDA (a
    plain torch.tensor(..., device=) copies from pageable memory and waits)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
