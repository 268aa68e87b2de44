"""Constants a compiled kernel exports, read from its cubin.

A template that lays out dynamic shared memory exports the size it needs as
`extern "C" __device__ const unsigned <entry>_smem_bytes`, so the launcher asks the
compiled module instead of repeating the layout's arithmetic in Python. A cubin is an
ELF file: the symbol table gives the constant's section and offset, and the section's
bytes hold its initial value. Reading the file needs no GPU (and so is CPU-tested).
"""
from __future__ import annotations

import struct
import weakref


class KernelSymbolError(LookupError):
    pass


def read_u32(cubin: bytes, name: str) -> int:
    """The initial value of the 32-bit global `name` in an ELF64 little-endian cubin."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise KernelSymbolError("not a 64-bit little-endian ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count = struct.unpack_from("<HH", cubin, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, align, entsize) of each section
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    symtab = next((s for s in sections if s[1] == 2), None)  # SHT_SYMTAB
    if symtab is None:
        raise KernelSymbolError("the cubin has no symbol table")
    strings = sections[symtab[6]][4]
    wanted = name.encode()
    for offset in range(symtab[4], symtab[4] + symtab[5], 24):
        st_name, _, _, shndx, value, size = struct.unpack_from("<IBBHQQ", cubin, offset)
        if cubin[strings + st_name:strings + st_name + len(wanted) + 1] != wanted + b"\0":
            continue
        section = sections[shndx]
        if size != 4 or section[1] != 1:  # SHT_PROGBITS: a constant with an initial value
            raise KernelSymbolError(f"{name} in the cubin is not an initialised 32-bit constant")
        return struct.unpack_from("<I", cubin, section[4] + value)[0]
    raise KernelSymbolError(f"the cubin exports no {name}")


_smem: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


def shared_memory_bytes(kernel) -> int:
    """Dynamic shared memory the kernel's layout needs, as it exports it (read once per compiled kernel)."""
    size = _smem.get(kernel)
    if size is None:
        size = _smem[kernel] = read_u32(kernel.cubin, f"{kernel.entry_name}_smem_bytes")
    return size
