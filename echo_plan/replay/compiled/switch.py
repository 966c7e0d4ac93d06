"""The one switch between the compiled (Numba) twins and the Python replay, and their one loader.

A :class:`CompiledSwitch` is an object, not module state: the simulation memo owns one (so a search,
which keeps one memo per process, decides once for all its plans), and whatever replays a large graph
outside a memo (the Chakra import) makes its own. The rest of the code asks it only:

* ``rates_for(n)``: the compiled event loop for a graph of ``n`` tasks, or None for the Python loop;
* ``level2()``: the compiled level-2 builder, or None for the Python ``build_tasks``;
* ``expect_many()``: many replays will follow (a search): load both now.

Modes (``ECHO_PLAN_JIT``, read when the switch is made): ``off`` (0/false/no) never compiles;
``on`` (1/true/yes) always does; ``auto`` (default) compiles where it pays. Loading costs what the
Python loop spends on ~120 thousand tasks (~5 us each), so in ``auto`` a single ``simulate`` stays
in Python while a search switches once its replays have passed ``after_tasks`` Python tasks, or for
one graph of ``min_tasks`` or more; the level-2 builder runs only once the loop is loaded. Both paths
give the same results bit for bit (tests/replay/test_engine_jit.py, test_pipeline_fast.py).

The loader imports both kernel modules and checks each on a small case against the Python code; a
kernel that cannot import or gives another answer is not used (one warning says why) and its Python
twin runs. Numba caches compiled code on disk: an unreadable cache file (a truncated index after a
full disk) is flushed and the kernel compiled again before it is given up.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any

from echo_plan.replay.compiled import level2
from echo_plan.replay.compiled.event_loop import run_with

JIT_MIN_TASKS = 100_000  # one graph this large pays for loading the compiled loop by itself
JIT_AFTER_TASKS = 150_000  # ... and so do this many tasks replayed by the Python loop
ENV_VAR = "ECHO_PLAN_JIT"
KERNEL_MODULES = ("echo_plan.replay.compiled.rates_kernel", "echo_plan.replay.compiled.step_kernel",
                  "echo_plan.replay.compiled.build_kernel")  # the modules that import Numba


class JitMode(str, Enum):
    OFF = "off"
    ON = "on"
    AUTO = "auto"

    @classmethod
    def from_text(cls, text: str | None) -> "JitMode":
        flag = (text or "auto").strip().lower()
        if flag in ("0", "false", "no", "off"):
            return cls.OFF
        return cls.ON if flag in ("1", "true", "yes", "on") else cls.AUTO


@dataclass(frozen=True)
class Kernels:
    """The loaded kernel modules; None where one cannot run here."""

    rates: Any
    build: Any


class CompiledSwitch:
    """Decides compiled vs Python and holds the kernels once loaded (module docstring). Not thread-safe."""

    def __init__(self, mode: JitMode = JitMode.AUTO, min_tasks: int = JIT_MIN_TASKS,
                 after_tasks: int = JIT_AFTER_TASKS) -> None:
        self.mode, self.min_tasks, self.after_tasks = mode, min_tasks, after_tasks
        self.python_tasks = 0  # tasks the Python loop replayed while this switch said "not yet"
        self._kernels: Kernels | None = None

    @classmethod
    def from_environment(cls) -> "CompiledSwitch":
        return cls(JitMode.from_text(os.environ.get(ENV_VAR)))

    @property
    def loaded(self) -> bool:
        return self._kernels is not None

    def kernels(self) -> Kernels:
        """Both kernels, loaded and checked on first use (None each where it cannot run or is off)."""
        if self._kernels is None:
            self._kernels = Kernels(None, None) if self.mode is JitMode.OFF else load_kernels()
        return self._kernels

    def rates_for(self, n_tasks: int) -> Any:
        """The compiled event loop for a graph of ``n_tasks``, or None: the Python loop replays it."""
        if self.mode is JitMode.OFF:
            return None
        if self.mode is JitMode.AUTO and not self.loaded:
            seen = self.python_tasks + n_tasks
            if n_tasks < self.min_tasks and seen < self.after_tasks:
                self.python_tasks = seen
                return None
        return self.kernels().rates

    def level2(self) -> Kernels | None:
        """The kernels for the compiled level 2 (build and loop), or None: in ``auto`` only once the loop
        is loaded (so a single ``simulate`` never loads Numba for it), and only where both run."""
        if self.mode is JitMode.OFF or (self.mode is JitMode.AUTO and not self.loaded):
            return None
        k = self.kernels()
        return k if k.rates is not None and k.build is not None else None

    def expect_many(self) -> None:
        """Many steps will be replayed (a search): load the kernels now, unless switched off."""
        if self.mode is not JitMode.OFF:
            self.kernels()


def load_kernels() -> Kernels:
    """The one loader: the event loop, then the level-2 builder, each checked against Python."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return Kernels(None, None)
    rates = _checked("the compiled replay loop", _import_rates, _check_rates)
    build = _checked("the compiled level-2 build", _import_build, lambda mod: _check_build(rates, mod)) \
        if rates is not None else None
    return Kernels(rates, build)


def _import_rates() -> Any:
    from echo_plan.replay.compiled import rates_kernel  # imports Numba: only when the switch loads it

    return rates_kernel


def _import_build() -> Any:
    from echo_plan.replay.compiled import build_kernel  # imports Numba: only when the switch loads it

    return build_kernel


def _check_rates(mod: Any) -> None:
    out = run_with(mod, 2, [1.0, 1.0], [0, 1], [0, 0], [0, 1], [(), ()], 2, 2, lambda p, others: 1.5)
    if out is None or out[1] != [1.5, 1.5]:
        raise RuntimeError(f"the compiled loop gave {out!r} on a two-task check")


def _check_build(rates: Any, mod: Any) -> None:
    if not level2.check_build(Kernels(rates, mod)):
        raise RuntimeError("the compiled level-2 build differs from build_tasks on a check step")


def _checked(what: str, importer, check) -> Any:  # noqa: ANN001
    """The module ``importer`` gives, once ``check`` passes on it; None with a warning otherwise.
    A failed check is retried once after flushing the module's on-disk Numba caches."""
    try:  # numba raises at import when no cache folder is writable, for one
        mod = importer()
    except Exception as exc:  # noqa: BLE001
        return _fallback(what, exc)
    error: Exception | None = None
    for attempt in range(2):
        try:
            check(mod)
            return mod
        except Exception as exc:  # noqa: BLE001 - anything Numba raises here means: do not use it
            error = exc
            if attempt == 0:
                _flush_caches()
    return _fallback(what, error)


def _flush_caches() -> None:
    """Empty the on-disk cache index of every jitted function of the kernel modules loaded so far (a
    kernel calls jitted helpers of another module: build_kernel those of step_kernel)."""
    import sys

    for name in KERNEL_MODULES:
        mod = sys.modules.get(name)
        for obj in vars(mod).values() if mod is not None else ():
            cache = getattr(obj, "_cache", None)
            if cache is not None and hasattr(cache, "flush"):
                cache.flush()


def _fallback(what: str, error: Exception | None) -> None:
    warnings.warn(f"echo-plan: {what} cannot be used ({type(error).__name__}: {error}); using the Python code, "
                  "which gives the same results more slowly", RuntimeWarning, stacklevel=4)
    return None
