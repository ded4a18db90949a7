"""A GGUF file's metadata and tensors, read fast: what `llama_cpp.read_gguf` needs of a file before llama.cpp
loads it.

gguf's `GGUFReader` parses every metadata array into numpy views, one per element: the embedded model's
49,152-token vocabulary and its merges took ~1.8 s a file on a 2-core Xeon, paid on every load of a GGUF (and
four times in a first run under `--dtype auto` on a CPU with AMX, one per weights format). This reads the same
layout (GGUF v2 and v3, little-endian) and walks past arrays without building them: the scalars and strings as
Python values, each tensor's name, type, shape and data (a view of the memory-mapped file, shaped as
`GGUFReader` shapes it, so `gguf.quants.dequantize` reads it alike). Any other file (big-endian, another
version): None, and the caller uses gguf's reader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
ALIGNMENT = 32  # general.alignment's default
SCALARS = {  # GGUF value type -> struct format (little-endian)
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Field:
    """One metadata value: a scalar or a string (an array's is None: never read here)."""

    value: object

    def contents(self):
        return self.value


@dataclass(frozen=True)
class Tensor:
    """One tensor: what `GGUFReader`'s tensors give of it."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's order: the innermost dimension first
    data: np.ndarray  # numpy's order; bytes per row for a block-quantized type


@dataclass(frozen=True)
class Header:
    fields: dict[str, Field]
    tensors: list[Tensor]


def read_header(path: str | Path) -> Header | None:
    """The file's metadata and tensors; None where this reader does not read the file (see the module)."""
    import gguf

    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    if bytes(buf[:4]) != MAGIC:
        raise ValueError("not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        return None  # big-endian files read as another version; GGUF v1 counted in 32 bits
    offset, fields = 24, {}
    for _ in range(n_kv):
        key, offset = _string(buf, offset)
        (kind,), offset = struct.unpack_from("<I", buf, offset), offset + 4
        value, offset = _value(buf, offset, kind)
        fields[key] = Field(value)
    infos = []
    for _ in range(n_tensors):
        name, offset = _string(buf, offset)
        (n_dims,) = struct.unpack_from("<I", buf, offset)
        dims = np.frombuffer(buf, dtype="<u8", count=n_dims, offset=offset + 4).copy()
        offset += 4 + 8 * n_dims
        kind, start = struct.unpack_from("<IQ", buf, offset)
        offset += 12
        infos.append((name, dims, kind, start))
    alignment = fields["general.alignment"].value if "general.alignment" in fields else ALIGNMENT
    base = offset + (-offset) % alignment
    tensors = []
    for name, dims, kind, start in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims))
        shape = tuple(int(d) for d in reversed(dims.tolist()))
        plain = _PLAIN.get(qtype.name)
        if plain is not None:
            array = np.frombuffer(data, dtype=plain, count=n, offset=base + start).reshape(shape)
        else:
            array = np.frombuffer(data, dtype=np.uint8, count=n * size // block, offset=base + start)
            array = array.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))
        tensors.append(Tensor(name, qtype, dims, array))
    return Header(fields, tensors)


_PLAIN = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


def _string(buf, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offset)
    return bytes(buf[offset + 8 : offset + 8 + n]).decode("utf-8"), offset + 8 + n


def _value(buf, offset: int, kind: int) -> tuple[object, int]:
    """(the value at `offset` of GGUF type `kind`, the offset past it); an array's value is None."""
    if kind in SCALARS:
        fmt = SCALARS[kind]
        return struct.unpack_from(fmt, buf, offset)[0], offset + struct.calcsize(fmt)
    if kind == STRING:
        return _string(buf, offset)
    if kind == ARRAY:
        item, count = struct.unpack_from("<IQ", buf, offset)
        offset += 12
        if item in SCALARS:
            return None, offset + count * struct.calcsize(SCALARS[item])
        if item == STRING:  # a vocabulary, its merges: each string's length read, its bytes skipped
            length = struct.Struct("<Q").unpack_from
            for _ in range(count):
                offset += 8 + length(buf, offset)[0]
            return None, offset
        for _ in range(count):  # nested arrays
            _, offset = _value(buf, offset, item)
        return None, offset
    raise ValueError(f"unknown GGUF value type {kind}")
