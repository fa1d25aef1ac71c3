"""The kernels' C interface, read from csrc/tokenmill.h: one ctypes struct per typedef, one prototype per entry
point, and the TM_ limits. Written once in the header, so Python and C cannot drift apart; fields are filled by
name and checked (every field given, pointers from tensors of the pointee's dtype or from tm_ structs)."""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "tokenmill.h"

_SCALARS = {"int": ctypes.c_int, "float": ctypes.c_float, "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32}
_DTYPES = {"float": (torch.float32,), "int32_t": (torch.int32,), "int64_t": (torch.int64,), "uint8_t": (torch.uint8,),
           "int8_t": (torch.int8,), "void": None, "int": (torch.int32,)}   # None: any dtype


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str              # the C base type: float, int, tm_qweight, ...
    pointer: bool


@dataclass(frozen=True)
class Function:
    name: str
    restype: str            # int, int64_t or const char *
    arg: Optional[str]      # the tm_ struct it takes by pointer, or None for (void)


@dataclass(frozen=True)
class Abi:
    structs: dict[str, tuple[Field, ...]]
    functions: dict[str, Function]
    limits: dict[str, int]


def parse(text: str) -> Abi:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    limits = {m[1]: int(m[2]) for m in re.finditer(r"^#define\s+(TM_\w+)\s+(-?\d+)\s*$", text, re.M)}
    structs: dict[str, tuple[Field, ...]] = {}
    for m in re.finditer(r"typedef\s+struct\s*(?:\w+\s*)?\{(.*?)\}\s*(\w+)\s*;", text, re.S):   # tagged too
        fields = []
        for decl in filter(None, (d.strip() for d in m[1].split(";"))):
            words = decl.replace("*", " * ").split()
            if "," in decl or not words[-1].isidentifier():
                raise ValueError(f"tokenmill.h: one plain field per declaration, not {decl!r}")
            base = [w for w in words[:-1] if w not in ("const", "volatile", "struct", "*")]
            fields.append(Field(words[-1], base[-1], "*" in words))
        structs[m[2]] = tuple(fields)
    functions = {}
    for m in re.finditer(r"TM_API\s+([\w\s]+?\**)\s*(tm_\w+)\s*\(([^)]*)\)\s*;", text):
        ret, arg = " ".join(m[1].split()), m[3].strip()
        functions[m[2]] = Function(m[2], ret, None if arg == "void" else arg.replace("const", "").split("*")[0].strip())
    return Abi(structs, functions, limits)


class Structs:
    """ctypes classes for an Abi's structs, and checked construction by field name."""

    def __init__(self, abi: Abi):
        self.abi = abi
        self.types: dict[str, type[ctypes.Structure]] = {}
        for name, fields in abi.structs.items():
            spec = [(f.name, ctypes.c_void_p if f.pointer else self._scalar(name, f)) for f in fields]
            self.types[name] = type(name, (ctypes.Structure,), {"_fields_": spec})
        # per struct, once: each field with the dtypes a tensor for it may have, and the set of names
        self._plans = {name: (tuple((f, _DTYPES.get(f.ctype, ())) for f in fields), frozenset(f.name for f in fields))
                       for name, fields in abi.structs.items()}

    def _scalar(self, struct: str, f: Field) -> Any:
        if f.ctype not in _SCALARS:
            raise ValueError(f"tokenmill.h: {struct}.{f.name} has type {f.ctype}, which the ABI does not map")
        return _SCALARS[f.ctype]

    def make(self, name: str, **values: Any) -> ctypes.Structure:
        """A `name` struct from every field by name: tensors, tm_ structs or ctypes arrays (or None) for pointers."""
        fields, names = self._plans[name]
        if values.keys() != names:
            given = set(values)
            raise TypeError(f"{name}: missing fields {sorted(names - given)}, unknown fields {sorted(given - names)}")
        args = []
        for f, allowed in fields:          # a plain loop: this runs for every kernel call a step makes
            v = values[f.name]
            if not f.pointer:
                args.append(v)
            elif isinstance(v, torch.Tensor) and v.is_cpu and (allowed is None or v.dtype in allowed):
                args.append(v.data_ptr())
            else:
                args.append(_address(name, f, v))
        return self.types[name](*args)


def _address(struct: str, f: Field, v: Any) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        allowed = _DTYPES.get(f.ctype, ())
        if v.device.type != "cpu" or (allowed is not None and v.dtype not in allowed):
            raise TypeError(f"{struct}.{f.name} takes a CPU tensor of {f.ctype}, got {v.dtype} on {v.device}")
        return v.data_ptr()
    if isinstance(v, ctypes.Structure):
        if type(v).__name__ != f.ctype:
            raise TypeError(f"{struct}.{f.name} takes a {f.ctype}, got a {type(v).__name__}")
        return ctypes.addressof(v)
    if isinstance(v, (ctypes.Array, ctypes._SimpleCData)) and f.ctype in ("void", "int"):
        return ctypes.addressof(v)
    raise TypeError(f"{struct}.{f.name} takes a tensor or a ctypes object, got {type(v).__name__}")
