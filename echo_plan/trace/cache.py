"""On-disk cache of traces, keyed by the content hash of their TraceKey.

File format (text): one header line of JSON, then the trace as JSON.
The header names the format and its version, the full key, and the SHA-256 of the payload; a
file whose header, key or checksum does not match is corrupt or foreign: it is reported once
(a ``TraceCacheWarning``), removed, counted, and the trace is made again. Writes go to a
temporary file in the same folder and are renamed into place, so concurrent writers (Ray
workers tracing the same key) each install a complete file and readers never see a partial one.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import replace
from pathlib import Path

from echo_plan.errors import EchoPlanError
from echo_plan.files import non_regular, write_atomic
from echo_plan.trace.records import LayerTrace, TraceKey
from echo_plan.trace.serialize import key_from_dict, key_to_dict, trace_from_dict, trace_to_dict

FORMAT = "echo-plan-trace"
FORMAT_VERSION = 1
ENV_VAR = "ECHO_PLAN_CACHE_DIR"


class TraceCacheWarning(UserWarning):
    """A cache file could not be trusted and was discarded."""


def default_cache_root() -> Path:
    """``$ECHO_PLAN_CACHE_DIR`` if set, else the user cache folder (platformdirs) / traces."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("echo-plan")) / "traces"


class TraceCache:
    """Traces on disk under ``root``; ``hits``, ``misses`` and ``corrupt`` count this instance's lookups.

    Traces read or written through this instance are also kept in memory (on the instance), so a
    search asking for the same key again does not re-read the file.
    """

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_cache_root()
        self.hits = 0
        self.misses = 0
        self.corrupt = 0
        self._memory: dict[TraceKey, LayerTrace] = {}
        self._bypassed: set[Path] = set()  # entries that cannot be used or replaced; reported once each

    def path_for(self, key: TraceKey) -> Path:
        return self.root / f"{key.stage.value}-{key.digest()}.json"

    def get(self, key: TraceKey) -> LayerTrace | None:
        kept = self._memory.get(key)
        if kept is not None:
            self.hits += 1
            return kept
        path = self.path_for(key)
        if path in self._bypassed:
            self.misses += 1
            return None
        if non_regular(path) is not None:  # a folder or FIFO in the way: reading could fail or block
            return self._bypass(path, "is not a regular file")
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            self.misses += 1
            return None
        except OSError as exc:
            return self._discard(path, f"unreadable ({exc.strerror or exc})")
        try:
            trace = self._decode(raw, key)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with an entry, it is traced again
            return self._discard(path, str(exc)[:200] or type(exc).__name__)
        self.hits += 1
        self._memory[key] = trace
        return trace

    def peek(self, key: TraceKey) -> LayerTrace | None:
        """The entry for ``key`` if one is here and sound; no counting, no warnings, nothing removed
        (the tracer borrows what a trace under another recompute mode already measured)."""
        kept = self._memory.get(key)
        if kept is not None:
            return kept
        path = self.path_for(key)
        if path in self._bypassed or non_regular(path) is not None:
            return None
        try:
            trace = self._decode(path.read_bytes(), key)
        except Exception:  # noqa: BLE001 - absent or unusable: the caller measures for itself
            return None
        self._memory[key] = trace
        return trace

    def put(self, trace: LayerTrace) -> None:
        payload = json.dumps(trace_to_dict(trace), separators=(",", ":")).encode()
        header = {
            "format": FORMAT, "version": FORMAT_VERSION, "digest": trace.key.digest(),
            "sha256": hashlib.sha256(payload).hexdigest(), "key": key_to_dict(trace.key),
        }
        data = json.dumps(header, separators=(",", ":")).encode() + b"\n" + payload
        path = self.path_for(trace.key)
        self._memory[trace.key] = replace(trace, from_cache=True)
        if path in self._bypassed:
            return
        try:
            write_atomic(path, data)  # several Ray workers may write the same key
        except EchoPlanError as exc:  # a folder in the way, a full disk: kept in memory for this run
            self._bypass(path, f"cannot be written ({exc})")

    @staticmethod
    def _decode(raw: bytes, key: TraceKey) -> LayerTrace:
        head, sep, payload = raw.partition(b"\n")
        if not sep:
            raise ValueError("no header line")
        header = json.loads(head)
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError("not an echo-plan trace file")
        if header.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {header.get('version')!r}, expected {FORMAT_VERSION}")
        if header.get("key") != key_to_dict(key) or header.get("digest") != key.digest():
            raise ValueError("written for a different trace key")
        if header.get("sha256") != hashlib.sha256(payload).hexdigest():
            raise ValueError("checksum mismatch (truncated or altered)")
        trace = trace_from_dict(json.loads(payload), from_cache=True)
        if trace.key != key:
            raise ValueError("payload key differs from the header")
        return trace

    def stored(self) -> tuple[list[LayerTrace], list[tuple[Path, str]]]:
        """Every sound trace file under ``root`` (sorted by name) and, for each file that is not one,
        its path and why; nothing is removed or counted (``calibrate kernels --traces`` reads a
        cache that a search or ``validate`` filled)."""
        traces: list[LayerTrace] = []
        refused: list[tuple[Path, str]] = []
        for path in sorted(self.root.glob("*.json")):
            if non_regular(path) is not None:
                refused.append((path, "is not a regular file"))
                continue
            try:
                raw = path.read_bytes()
                key = key_from_dict(json.loads(raw.partition(b"\n")[0])["key"])
                traces.append(self._decode(raw, key))
            except Exception as exc:  # noqa: BLE001 - a file that is not a sound trace is named, not read
                refused.append((path, str(exc)[:200] or type(exc).__name__))
        return traces, refused

    def _bypass(self, path: Path, why: str) -> None:
        self.misses += 1
        if path not in self._bypassed:
            self._bypassed.add(path)
            warnings.warn(f"trace cache: {path} {why}; not using it (remove it to cache this trace again)",
                          TraceCacheWarning, stacklevel=3)
        return None

    def _discard(self, path: Path, why: str) -> None:
        self.corrupt += 1
        self.misses += 1
        warnings.warn(f"trace cache: discarding {path}: {why}; tracing again", TraceCacheWarning, stacklevel=3)
        try:
            path.unlink()
        except OSError:
            pass
        return None
