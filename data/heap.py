"""The glibc heap policy of a CPU run: the training process keeps freed blocks, its data-loader workers give theirs back.

Both calls do nothing where the C library is not glibc."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def _libc(name: str) -> Callable | None:
    """The C library's function `name`, or None where this process's C library has none."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None


def keep_freed_memory() -> bool:
    """Let glibc keep freed blocks for reuse instead of handing every block over 32 MB back to the kernel.

    A CPU step allocates and frees the same big buffers each time (a 16 x 256 x 32000 logits tensor is 524 MB); by
    default each is unmapped when freed and page-faulted back in on the next step, so that about half of the tiny
    LM's step was system time (bench.malloc: 1.7x). Returns False where the C library has no `mallopt` (not glibc)."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30) and mallopt(_M_TRIM_THRESHOLD, 1 << 31))


def release_freed_memory(worker_id: int = 0) -> None:
    """`worker_init_fn` of every DataLoader with workers: hand the free heap pages a forked worker inherits back to
    the kernel (glibc `malloc_trim`).

    The parent keeps freed blocks for reuse (`keep_freed_memory`), so after a long step its heap holds gigabytes of
    free pages, which a worker forked then shares copy-on-write; when the parent writes them again the kernel copies
    them, and the run holds its peak twice for as long as the worker lives (a validation loader's workers live until
    the next validation). Measured: a 2,048-segment ARMT stage at 6 GB held 12, and two side by side were killed for
    memory. The worker's own, live data stays shared as before."""
    malloc_trim = _libc("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)
