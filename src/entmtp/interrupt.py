"""Stopping a prefill forward part way, so that a short prompt need not wait for a long prompt's chunk.

A server prefills a long prompt one chunk per step between its other rows' steps (batch.py); a chunk deep in
an 8k-token prompt takes seconds on two CPU cores, and a short request that arrives meanwhile would wait for
it. So the batch hands a chunk's forward an `Interrupt`, which the server's worker raises when a new request
arrives: the forward stops between two layers (transformers: `KVCache.update`, before a layer writes) or two
graph nodes (llama.cpp: its abort callback), raises `Preempted`, and leaves the cache as it was before the
call. The chunk runs again later, whole, with the same boundaries, so its numbers are the ones it would have
had (a prompt's chunks never change: engine.prefill_chunk). Only a causal chain (a prefill) is ever
interrupted; a tree's verification never is.

llama.cpp asks its abort callback after every graph node (about a thousand a forward) from its compute thread.
A Python callback would take the GIL each time; so the callback is the C library's `strlen` over the flag's two
bytes (the flag, then a zero): it returns 0 while the flag is down and 1 once it is raised, read by C alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


class Preempted(Exception):
    """A prefill forward stopped by its `Interrupt`; the cache is as it was before the call."""


class Interrupt:
    """A flag one thread raises (`set`) to stop another thread's prefill forward between two layers."""

    def __init__(self):
        self.flag = ctypes.create_string_buffer(2)  # [flag, 0]: strlen of it is 1 once raised, else 0

    def set(self) -> None:
        self.flag[0] = b"\x01"

    def clear(self) -> None:
        self.flag[0] = b"\x00"

    def is_set(self) -> bool:
        return self.flag[0] != b"\x00"

    @property
    def address(self) -> int:
        """The flag's address, the abort callback's data (llama.cpp)."""
        return ctypes.addressof(self.flag)


@functools.cache
def strlen_address() -> int:
    """The address of the C library's `strlen`: a `bool (*)(void *)` that reads the flag without Python."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    return ctypes.cast(libc.strlen, ctypes.c_void_p).value
