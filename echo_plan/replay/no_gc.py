"""Pause Python's cyclic garbage collector around a level-2 replay.

A level-2 step builds tens of thousands of small tuples and lists that all stay alive until the
replay ends; each 700 of them start a collection that walks the young objects again, and the
survivors soon start full collections. None of it is garbage and none of it forms cycles, so the
collector only costs time: with it on, building one 13k-task step took 38-71 ms, without it 26 ms
(``benchmarks/engine_bench.py``). Reference counting still frees everything as usual; the
collector is switched back on (if it was on) when the block ends, even on an error.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused_gc() -> Iterator[None]:
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
