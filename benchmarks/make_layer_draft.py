#!/usr/bin/env python3
"""A draft model cut from a GGUF model: its first N transformer layers, then its own final norm and head (an
early-exit draft, as LayerSkip drafts). It shares the model's tokenizer and vocabulary by construction, so it serves
as speculative_config's draft model where no smaller sibling exists (the bundled SmolLM2-135M has none).

  .venv/bin/python benchmarks/make_layer_draft.py OUT.gguf [--layers 8] [--model PATH]
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path


def cut_layers(src: str, dst: str, layers: int) -> None:
    import gguf
    reader = gguf.GGUFReader(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    count_key = f"{arch}.block_count"
    total = int(reader.fields[count_key].contents())
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in [1, {total}] for this model, got {layers}")
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue                      # the writer writes these itself
        kind = field.types[0]
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    kept = [t for t in reader.tensors
            if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled model)")
    args = ap.parse_args()
    from tokenmill.executor.loader import resolve_model_path
    src = resolve_model_path(args.model)
    if Path(src).is_dir():
        src = str(next(Path(src).glob("*.gguf")))
    cut_layers(src, str(args.out), args.layers)
    print(f"wrote {args.out}: the first {args.layers} layers of {src}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
