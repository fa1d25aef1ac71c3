"""CUDA-graph safety on a CPU: what a captured step may not do, checked while the step runs, and a count of the ops
a step launches (DESIGN.md, "The runner, per device").

A CUDA graph records the kernels a step launches, with the addresses they read and write, and replays them: the
Python that chose them does not run again. So a step captured into a graph may not

- wait on the device: `.item()`, `int(t)`, `float(t)`, `bool(t)`, `torch.equal`, a copy to the host;
- take a shape from data: `nonzero`, `masked_select`, `unique`, indexing by a bool mask, `repeat_interleave`
  without `output_size` (each reads a count on the host first);
- read a tensor from Python without the dispatcher: `.tolist()`, `.numpy()`, `np.asarray(t)`;
- build a tensor from Python values (`torch.tensor([...])`, `torch.as_tensor`): its contents are frozen at capture,
  and on the GPU it is a copy from pageable host memory, which a capture refuses;
- read memory that does not live across replays: a tensor made before the step that is not one of its static
  buffers (static inputs and outputs, parameters and buffers, KV cache) is baked in by address, and the allocator
  may hand that address to something else before the next replay;
- allocate on another device than the step's.

GraphSafetyMode records each of these (with the line of the caller's code that did it) while a step runs under it;
allocations on the step's device are allowed (a graph's private pool serves them). OpCounter counts the ops that
launch work, in all and per module (e.g. per decoder layer).

    with GraphSafetyMode([model, kv_caches, input_ids, positions], device) as mode:
        model(input_ids, positions, backend, metas)
    mode.check()        # raises GraphSafetyError listing every violation

The checks see what reaches the PyTorch dispatcher: a kernel called through ctypes or a custom op's own body is not
looked into (a custom op is checked, and counted, at its boundary: its arguments).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import traceback
import weakref
from collections import Counter
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["GraphSafetyMode", "GraphSafetyError", "Violation", "OpCounter", "static_tensors"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)

# ops that hand a device value to the host (beyond those tagged data_dependent_output)
_HOST_SYNC = {"aten._local_scalar_dense", "aten.item", "aten.equal", "aten.allclose", "aten.is_nonzero"}
# ops whose output's shape is read from data (beyond those tagged dynamic_output_shape); aten.index and
# aten.index_put only where an index is a mask (see _data_dependent_shape)
_DYNAMIC_SHAPE = {"aten.nonzero", "aten.masked_select", "aten.bincount", "aten.argwhere", "aten.nonzero_numpy",
                  "aten.histc"}
# a tensor built from Python values (torch.tensor, torch.as_tensor of a list or an array): the C++ builds it outside
# the dispatcher and then calls one of these on it. Not aten.scalar_tensor: a fill of one Python number on the
# step's device (torch.where(c, x, 0.0) issues it), as capture-safe as torch.full
_FROM_PYTHON = {"aten.lift_fresh", "aten.lift_fresh_copy", "aten.lift"}
# copies from one tensor into another: (destination, source) are their first two arguments
_COPY_INTO = {"aten.copy_", "aten.copy", "aten._copy_from", "aten._copy_from_and_resize"}
# conversions: (tensor, to a device named in their arguments)
_CONVERT = {"aten._to_copy", "aten.to"}
# ops that take only metadata (shape, dtype, device) from their tensor arguments, never their contents
_METADATA_READERS = {"aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.rand_like",
                     "aten.randn_like", "aten.randint_like", "aten.new_empty", "aten.new_empty_strided",
                     "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.sym_size", "aten.sym_stride",
                     "aten.sym_numel", "aten.sym_storage_offset", "aten.is_same_size", "aten._assert_tensor_metadata"}
# ops that launch no work: allocations without a fill, metadata, and the lifting of a tensor Python built
_NO_WORK = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.empty_permuted", "aten.new_empty",
            "aten.new_empty_strided", "aten._unsafe_view", "aten.detach", "aten.detach_", "aten.alias",
            "aten.lift_fresh",
            "aten.lift_fresh_copy", "aten.lift", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
            "aten.sym_storage_offset", "aten.is_same_size", "aten.resize_", "aten.set_", "aten.record_stream",
            "aten._assert_scalar", "aten._assert_tensor_metadata", "aten.sym_constrain_range",
            "aten.sym_constrain_range_for_size", "aten._functional_sym_constrain_range"}


def _op_name(func) -> str:
    """'aten.addmm', 'mylib.scale_': the op's namespace and name, without the overload."""
    return str(func.overloadpacket)


def _may_alias(func) -> bool:
    """Whether the op's schema says it may return an alias of an input without writing it (`Tensor(a)`, not the
    `Tensor(a!)` of an in-place or out= op): every view op (view, t, select, slice, expand, split, ...),
    detach/alias/lift_fresh, with no list to keep, custom ops that declare their aliasing included. A few such ops
    alias only sometimes: to, reshape, contiguous, resolve_conj (reaching a dispatch mode whole under
    inference_mode) copy when they must; _copied() tells, once the op has run."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _copied(args, kwargs, out) -> bool:
    """Whether an op returned a tensor in memory of its own rather than one of its inputs'."""
    inputs = {id(s) for s in map(_storage_of, _tensors((args, kwargs))) if s is not None}
    return any(s is not None and id(s) not in inputs for s in map(_storage_of, _tensors(out)))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """'cuda' matches 'cuda:0': the index counts only where both name one."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _is_cpu_scalar(t: torch.Tensor) -> bool:
    """A 0-dim CPU tensor: a device kernel takes its value as an argument, frozen at capture like a Python number."""
    return t.dim() == 0 and t.device.type == "cpu"


def _caller_line() -> str:
    """The innermost frame outside torch and this module: the line of the step's code that issued the op."""
    for frame in reversed(traceback.extract_stack()):
        name = os.path.abspath(frame.filename)
        if name.startswith(_TORCH_DIR) or name == _THIS_FILE:
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "<unknown>"


def static_tensors(*objs: Any) -> Iterator[torch.Tensor]:
    """The tensors in objs: tensors, modules (their parameters and buffers), dataclass instances (their fields),
    and lists, tuples, sets and dicts (their values) of these, nested."""
    seen: set[int] = set()

    def walk(obj: Any) -> Iterator[torch.Tensor]:
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, nn.Module):
            yield from obj.parameters()
            yield from obj.buffers()
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from walk(v)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                yield from walk(v)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                yield from walk(getattr(obj, f.name))

    for o in objs:
        yield from walk(o)


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str       # host_sync | dynamic_shape | python_read | python_value | outside_tensor | other_device | host_copy
    op: str         # 'aten._local_scalar_dense', 'Tensor.tolist', ...
    reason: str
    where: str      # 'path:line in function: code', the caller's line that issued it

    def __str__(self) -> str:
        return f"[{self.kind}] {self.op}: {self.reason}\n      at {self.where}"


class GraphSafetyError(RuntimeError):
    def __init__(self, violations: Sequence[Violation]):
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} CUDA-graph safety violation(s):\n{lines}")


class _Storages:
    """A set of tensor storages, held weakly. A storage is known by its data pointer and its Python object (which
    PyTorch keeps, one per storage, while the storage lives): the pair tells a freed storage from a new one that the
    allocator put at the same address, and storages of no memory (meta, empty) apart."""

    def __init__(self):
        self._refs: dict[tuple[int, int], weakref.ref] = {}

    @staticmethod
    def _key(st) -> tuple[int, int]:
        return st.data_ptr(), id(st)

    def add(self, t: torch.Tensor) -> None:
        st = _storage_of(t)
        if st is None:
            return
        key, refs = self._key(st), self._refs

        def forget(ref, key=key):
            if refs.get(key) is ref:
                del refs[key]

        refs[key] = weakref.ref(st, forget)

    def __contains__(self, t: torch.Tensor) -> bool:
        st = _storage_of(t)
        if st is None:
            return False
        ref = self._refs.get(self._key(st))
        return ref is not None and ref() is st


class _EagerMode(TorchDispatchMode):
    """A dispatch mode for eager steps. torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable, whose first
    call imports dynamo (~2 s, hundreds of modules) to keep torch.compile out of the mode's own frames; nothing here
    is compiled, so the wrapping is declined."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _target_device(args, kwargs) -> Optional[torch.device]:
    """The device a conversion (_to_copy, to.*) goes to: a `device` argument, or to.other's tensor's; None: stays."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, torch.device):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def _storage_of(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):       # a tensor subclass without storage
        return None


class GraphSafetyMode(_EagerMode):
    """Records what a step does that a CUDA graph capture forbids (see the module's docstring).

    static: the tensors whose memory lives across replays and that the step may read and write (anything
    static_tensors() takes: tensors, modules, dataclasses, containers). device: the step's device; a CPU stand-in
    for a GPU step passes "cpu" (copies to the host are then not told from any other copy). strict: raise
    GraphSafetyError at the first violation, in the offending call, instead of recording it. allow_python_scalars:
    let the step build 0-dim CPU tensors from Python numbers (`x * torch.tensor(2.0)`), which a capture freezes like
    any Python number; off by default, since the same code with `device=` on the GPU is a host-to-device copy.

    The patched Python reads (Tensor.tolist/numpy/__array__/item) are recorded only on the thread that entered.
    """

    def __init__(self, static: Any = (), device: Union[str, torch.device] = "cpu", *, strict: bool = False,
                 allow_python_scalars: bool = False):
        super().__init__()
        self.device = torch.device(device)
        self.strict = strict
        self.allow_python_scalars = allow_python_scalars
        self.violations: list[Violation] = []
        self._static = _Storages()
        for t in static_tensors(static):
            self._static.add(t)
        self._made = _Storages()            # storages of the outputs of ops issued under the mode
        self._reported = _Storages()        # outside storages already reported (once each)
        self._python_read_depth = 0
        self._thread: Optional[int] = None
        self._saved: list[tuple[str, bool, Any]] = []

    # ---- results --------------------------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        return not self.violations

    def check(self) -> None:
        """Raise GraphSafetyError listing every violation, if there is one."""
        if self.violations:
            raise GraphSafetyError(self.violations)

    def _record(self, kind: str, op: str, reason: str) -> None:
        v = Violation(kind, op, reason, _caller_line())
        self.violations.append(v)
        if self.strict:
            raise GraphSafetyError([v])

    # ---- entering: the Python reads that bypass the dispatcher ------------------------------------------------
    def __enter__(self):
        self._thread = threading.get_ident()
        self._patch()
        try:
            return super().__enter__()
        except BaseException:
            self._unpatch()
            raise

    def __exit__(self, exc_type, exc_val, exc_tb):
        try:
            return super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            self._unpatch()

    def _patch(self) -> None:
        for name, kind, why in (("tolist", "python_read", "reads the tensor's values into Python (a host sync)"),
                                ("numpy", "python_read", "reads the tensor's values into NumPy (a host sync)"),
                                ("__array__", "python_read", "reads the tensor's values into NumPy (a host sync)"),
                                ("item", "host_sync", "hands a device value to Python: the step would wait on the "
                                                      "device")):
            had = name in torch.Tensor.__dict__
            original = getattr(torch.Tensor, name)
            self._saved.append((name, had, torch.Tensor.__dict__.get(name)))
            setattr(torch.Tensor, name, self._python_read(name, kind, original, why))

    def _unpatch(self) -> None:
        while self._saved:
            name, had, value = self._saved.pop()
            if had:
                setattr(torch.Tensor, name, value)
            else:
                delattr(torch.Tensor, name)

    def _python_read(self, name: str, kind: str, original: Callable, why: str) -> Callable:
        """Tensor.<name> recording a violation (once: the dispatcher's ops under it are not looked at)."""
        mode = self

        def read(self, *args, **kwargs):
            if threading.get_ident() != mode._thread:
                return original(self, *args, **kwargs)
            if mode._python_read_depth == 0:     # __array__ calls numpy, item dispatches _local_scalar_dense
                mode._record(kind, f"Tensor.{name}", why)
            mode._python_read_depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                mode._python_read_depth -= 1

        read.__name__ = name
        read.__doc__ = getattr(original, "__doc__", None)
        return read

    # ---- the ops ----------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inspect = self._python_read_depth == 0
        name, alias = _op_name(func), _may_alias(func)
        if inspect:
            self._inspect(name, func, args, kwargs, reads=not alias)
        out = func(*args, **kwargs)
        if inspect and alias and name not in _FROM_PYTHON and _copied(args, kwargs, out):
            self._check_reads(name, _tensors((args, kwargs)))      # a conversion or reshape that had to copy
        self._note_outputs(name, args, kwargs, out)
        return out

    def _inspect(self, name: str, func, args, kwargs, reads: bool) -> None:
        """The checks made before the op runs (reads: whether to check its tensor arguments now)."""
        tags = func.tags
        if name in _HOST_SYNC or torch.Tag.data_dependent_output in tags:
            self._record("host_sync", name, "hands a device value to the host: the step would wait on the device")
        elif self._data_dependent_shape(name, func, args, kwargs):
            self._record("dynamic_shape", name, "its output's shape depends on the data: the size is read on the host")
        if name in _FROM_PYTHON:
            t = args[0] if args else None
            if not (self.allow_python_scalars and isinstance(t, torch.Tensor) and _is_cpu_scalar(t)):
                self._record("python_value", name, "a tensor built from Python values (torch.tensor/as_tensor): "
                             "frozen at capture, and a pageable host copy on the GPU")
            return          # its input is the fresh tensor Python just built, reported here
        if self.device.type != "cpu":
            self._check_host_copy(name, args, kwargs)
        if reads and name not in _METADATA_READERS:
            self._check_reads(name, _tensors((args, kwargs)))

    @staticmethod
    def _data_dependent_shape(name: str, func, args, kwargs) -> bool:
        if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl",
                    "aten._index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
        if name == "aten.repeat_interleave":     # repeats given as a tensor: its sum is the size, unless told
            return func._overloadname != "self_int" and kwargs.get("output_size") is None
        if name == "aten.one_hot":
            num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
            return num_classes == -1
        return name in _DYNAMIC_SHAPE or name.startswith(("aten.unique", "aten._unique")) or \
            torch.Tag.dynamic_output_shape in func.tags

    def _check_host_copy(self, name: str, args, kwargs) -> None:
        """A copy from the step's device to the host: a sync (and, captured, a copy into memory that replays don't
        hand back)."""
        if name in _CONVERT:
            src, dst = args[0], _target_device(args, kwargs)
            if dst is not None and dst.type == "cpu" and src.device.type != "cpu":
                self._record("host_copy", name, "copies a device tensor to the host")
        elif name in _COPY_INTO and len(args) >= 2:
            dst, src = args[0], args[1]
            if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and \
                    dst.device.type == "cpu" and src.device.type != "cpu":
                self._record("host_copy", name, "copies a device tensor into a host tensor")

    def _check_reads(self, name: str, inputs: list[torch.Tensor]) -> None:
        """Every tensor the op reads or writes must be static, made inside the step, or a CPU scalar."""
        for t in inputs:
            if t.numel() == 0 or _is_cpu_scalar(t) or _storage_of(t) is None:
                continue
            if t in self._static or t in self._made or t in self._reported:
                continue
            self._reported.add(t)
            self._record("outside_tensor", name,
                         f"reads a {tuple(t.shape)} {t.dtype} tensor on {t.device} made outside the step and not "
                         f"declared static: a graph bakes its address in, which may be reused before a replay")

    def _note_outputs(self, name: str, args, kwargs, out) -> None:
        """The op's new outputs become known (views and in-place results keep their input's standing); any made on
        another device than the step's is reported."""
        outputs = _tensors(out)
        if not outputs:
            return
        inputs = _tensors((args, kwargs))
        in_storages = {id(s) for s in map(_storage_of, inputs) if s is not None}
        for t in outputs:
            st = _storage_of(t)
            if st is None:
                continue
            if id(st) not in in_storages or name in _FROM_PYTHON:
                self._made.add(t)
            else:
                continue         # an alias or in-place result: no new memory
            if self._python_read_depth == 0 and not _same_device(t.device, self.device) and not (
                    _is_cpu_scalar(t) or name in _FROM_PYTHON or
                    (name in _CONVERT and self.device.type != "cpu" and t.device.type == "cpu")):
                self._record("other_device", name, f"allocates on {t.device}, not the step's device {self.device}")


class OpCounter(_EagerMode):
    """Counts the ops a step issues that launch work: every op but

    - views and aliases: ops whose schema returns an alias of an input that it does not write (`Tensor(a)`, see
      _may_alias): view, t, select, slice, expand, split, detach, lift_fresh, ... They only make tensor metadata.
      The few of them that copy when they must (to, reshape, contiguous) count when they did: when an output's
      storage is none of the inputs'. An in-place or out= op (`Tensor(a!)`) writes, and counts;
    - the metadata-only ops of _NO_WORK: allocations without a fill (empty*), sizes, resize_, asserts on shapes.

    A custom op (torch.library.custom_op) counts as one: its body runs below the mode. What reaches the mode is
    the dispatcher's view: with autograd on or under no_grad, an op that CompositeImplicitAutograd implements
    (linear, matmul, rms_norm, scaled_dot_product_attention, ...) is decomposed before it gets here and each op of
    its decomposition counts (F.linear: `t`, a view, + `addmm`); under inference_mode it arrives whole and counts
    as one. Compare counts made in the same mode.

    modules: optional; each op issued while one of them runs its forward is also counted against it (the innermost
    one where they nest): per_layer() gives one count per module, outside() the ops in none of them.
    """

    def __init__(self, modules: Sequence[nn.Module] = ()):
        super().__init__()
        self.modules = list(modules)
        self.counts: Counter[str] = Counter()
        self.layer_counts: list[Counter[str]] = [Counter() for _ in self.modules]
        self.outside_counts: Counter[str] = Counter()
        self._stack: list[int] = []
        self._hooks: list = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def per_layer(self) -> list[int]:
        return [sum(c.values()) for c in self.layer_counts]

    def outside(self) -> int:
        return sum(self.outside_counts.values())

    def reset(self) -> None:
        self.counts.clear()
        self.outside_counts.clear()
        for c in self.layer_counts:
            c.clear()

    @staticmethod
    def launches_work(func) -> Optional[bool]:
        """True/False: whether the op launches work; None: only its outputs tell (an op that may alias)."""
        if _op_name(func) in _NO_WORK:
            return False
        return None if _may_alias(func) else True

    def __enter__(self):
        for i, m in enumerate(self.modules):
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args, i=i: self._stack.append(i)))
            self._hooks.append(m.register_forward_hook(lambda mod, args, out, i=i: self._leave(i), always_call=True))
        try:
            return super().__enter__()
        except BaseException:
            self._remove_hooks()
            raise

    def __exit__(self, exc_type, exc_val, exc_tb):
        try:
            return super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            self._remove_hooks()
            self._stack.clear()

    def _leave(self, i: int) -> None:
        if self._stack and self._stack[-1] == i:
            self._stack.pop()
        elif i in self._stack:           # a forward left out of order (an exception): drop it and what's above it
            del self._stack[len(self._stack) - 1 - self._stack[::-1].index(i):]

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        work = self.launches_work(func)
        if work or (work is None and _copied(args, kwargs, out)):
            name = _op_name(func)
            self.counts[name] += 1
            (self.layer_counts[self._stack[-1]] if self._stack else self.outside_counts)[name] += 1
        return out
