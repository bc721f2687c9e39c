"""The environment a process has *now*, not the one it started with.

``/proc/PID/environ`` is the block the process was started with; ``os.environ["RANK"] = …`` (Ray Train's workers,
OpenRLHF's actors, many hand-written launchers do it before ``init_process_group("env://")``) changes libc's
``environ`` array in the process's memory instead. That array is what torch's ``env://`` rendezvous reads, so it is
the process's own word on its rank. Read here through ``/proc/PID/mem`` (the permission py-spy needs: the same user,
or ``CAP_SYS_PTRACE``), without stopping the process: the address of libc's ``environ`` comes from libc's dynamic
symbol table and its load address in ``/proc/PID/maps``. Standard library only; anything unreadable is None.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Collection

_LIBC = re.compile(r"/libc(?:\.so\.\d+|-[\d.]+\.so)$")
_SYMBOLS = (b"environ", b"__environ")
_MAX_VARS = 8192
_MAX_VALUE = 4096
_offsets: dict[tuple[str, int, float], int | None] = {}  # (libc path, inode, mtime) → environ's offset in it


def _environ_offset(path: str) -> int | None:
    """The offset of libc's ``environ`` from its load base (64-bit little-endian ELF), or None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    try:
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        loads = [struct.unpack_from("<IIQQ", data, phoff + i * phentsize) for i in range(phnum)]
        base_vaddr = min(v for t, _flags, _off, v in loads if t == 1) & ~0xFFF  # PT_LOAD
        sections = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
        for _name, sh_type, _flags, _addr, off, size, link, _info in sections:
            if sh_type != 11:  # SHT_DYNSYM
                continue
            str_off = sections[link][4]
            for at in range(off, off + size, 24):
                st_name, _st_info, _other, _shndx, value, _size = struct.unpack_from("<IBBHQQ", data, at)
                end = data.index(b"\0", str_off + st_name)
                if data[str_off + st_name:end] in _SYMBOLS and value:
                    return value - base_vaddr
    except (struct.error, ValueError, IndexError):
        return None
    return None


def _libc(pid: int) -> tuple[int, str] | None:
    """(load base, path) of the libc mapped into ``pid``."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and _LIBC.search(parts[5].strip()) and int(parts[2], 16) == 0:
                    return int(parts[0].split("-")[0], 16), f"/proc/{pid}/root{parts[5].strip()}"
    except (OSError, ValueError):
        return None
    return None


def live_env(pid: int, keys: Collection[str]) -> dict[str, str] | None:
    """``keys`` as they are in ``pid``'s environment now (absent ones left out); None when it cannot be read."""
    lib = _libc(pid)
    if lib is None:
        return None
    base, path = lib
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_ino, st.st_mtime)
    if key not in _offsets:
        _offsets[key] = _environ_offset(path)
    offset = _offsets[key]
    if offset is None:
        return None
    wanted = {k.encode() + b"=" for k in keys}
    out: dict[str, str] = {}
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        (array,) = struct.unpack("<Q", os.pread(fd, 8, base + offset))
        for i in range(0, _MAX_VARS, 256):
            chunk = os.pread(fd, 8 * 256, array + 8 * i)
            pointers = struct.unpack(f"<{len(chunk) // 8}Q", chunk)
            for ptr in pointers:
                if ptr == 0:
                    return out
                text = os.pread(fd, _MAX_VALUE, ptr).split(b"\0", 1)[0]
                name = next((w for w in wanted if text.startswith(w)), None)
                if name is not None:
                    out[name[:-1].decode()] = text[len(name):].decode(errors="replace")
            if len(pointers) < 256:
                break
    except (OSError, struct.error):
        return None
    finally:
        os.close(fd)
    return out


__all__ = ["live_env"]
