"""The trace cache: hits on the second call, never trusts a damaged or foreign file."""

import json
import warnings

import pytest

from echo_plan.specs import DType, Recompute
from echo_plan.trace.cache import TraceCache, TraceCacheWarning
from echo_plan.trace.tracer import trace_stage
from echo_plan.trace.keys import make_key
from echo_plan.trace.records import StageKind

ARGS = dict(tp=2, sequence_parallel=False, micro_batch_size=1, dtype=DType.BF16, recompute=Recompute.NONE)


def test_second_call_hits_and_returns_the_same_trace(tmp_path, gpt_small):
    cache = TraceCache(tmp_path)
    first = trace_stage(gpt_small, StageKind.BLOCK, cache=cache, **ARGS)
    assert not first.from_cache and (cache.hits, cache.misses) == (0, 1)
    second = trace_stage(gpt_small, StageKind.BLOCK, cache=cache, **ARGS)
    assert second.from_cache and (cache.hits, cache.misses) == (1, 1)
    assert second.ops == first.ops and second.key == first.key
    assert second.saved_bytes_by_mode == first.saved_bytes_by_mode and second.param_count == first.param_count
    other = trace_stage(gpt_small, StageKind.BLOCK, cache=cache, **{**ARGS, "tp": 4})
    assert not other.from_cache and cache.misses == 2
    reread = TraceCache(tmp_path).get(first.key)  # a new instance reads the file
    assert reread is not None and reread.ops == first.ops


def test_instance_keeps_what_it_read(tmp_path, gpt_small):
    cache = TraceCache(tmp_path)
    trace = trace_stage(gpt_small, StageKind.OUTPUT, cache=cache, **ARGS)
    cache.path_for(trace.key).unlink()
    kept = cache.get(trace.key)
    assert kept is not None and kept.from_cache and kept.ops == trace.ops
    assert TraceCache(tmp_path).get(trace.key) is None


@pytest.mark.parametrize("damage", ["garbage", "truncate", "flip", "foreign", "old_version"])
def test_damaged_entry_is_reported_once_and_retraced(tmp_path, gpt_small, damage):
    cache = TraceCache(tmp_path)
    good = trace_stage(gpt_small, StageKind.EMBEDDING, cache=cache, **ARGS)
    path = cache.path_for(good.key)
    raw = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"\x80\x04not a trace")
    elif damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":  # one digit changed inside the payload: only the checksum can tell
        head, _, payload = raw.partition(b"\n")
        i = payload.index(b'"param_count":') + len(b'"param_count":')
        digit = payload[i:i + 1]
        payload = payload[:i] + (b"9" if digit != b"9" else b"8") + payload[i + 1:]
        path.write_bytes(head + b"\n" + payload)
    elif damage == "foreign":  # a valid file, but for another key, under this key's name
        other = trace_stage(gpt_small, StageKind.EMBEDDING, cache=cache, **{**ARGS, "tp": 4})
        path.write_bytes(cache.path_for(other.key).read_bytes())
    else:
        head, _, payload = raw.partition(b"\n")
        header = json.loads(head)
        header["version"] = 0
        path.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    fresh = TraceCache(tmp_path)
    with pytest.warns(TraceCacheWarning) as record:
        again = trace_stage(gpt_small, StageKind.EMBEDDING, cache=fresh, **ARGS)
    assert len(record) == 1 and str(path) in str(record[0].message)
    assert not again.from_cache and fresh.corrupt == 1 and fresh.hits == 0
    assert again.ops == good.ops
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # repaired: no second report
        assert trace_stage(gpt_small, StageKind.EMBEDDING, cache=fresh, **ARGS).from_cache
    assert fresh.corrupt == 1


def test_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO_PLAN_CACHE_DIR", str(tmp_path / "env-cache"))
    assert TraceCache().root == tmp_path / "env-cache"
    assert TraceCache(tmp_path / "flag").root == tmp_path / "flag"
    monkeypatch.delenv("ECHO_PLAN_CACHE_DIR")
    assert TraceCache().root.name == "traces"


def test_key_covers_what_changes_a_trace(gpt_small, llama_small):
    base = make_key(gpt_small, StageKind.BLOCK, **ARGS)
    variants = [
        make_key(gpt_small, StageKind.BLOCK, **{**ARGS, "tp": 4}),
        make_key(gpt_small, StageKind.BLOCK, **{**ARGS, "sequence_parallel": True}),
        make_key(gpt_small, StageKind.BLOCK, **{**ARGS, "micro_batch_size": 2}),
        make_key(gpt_small, StageKind.BLOCK, **{**ARGS, "dtype": DType.FP16}),
        make_key(gpt_small, StageKind.BLOCK, **{**ARGS, "recompute": Recompute.FULL}),
        make_key(gpt_small.model_copy(update={"seq_length": 256}), StageKind.BLOCK, **ARGS),
        make_key(llama_small, StageKind.BLOCK, **ARGS),
        make_key(gpt_small, StageKind.BLOCK, **ARGS, version="another-code-version"),
        make_key(gpt_small, StageKind.OUTPUT, **ARGS),
    ]
    digests = {k.digest() for k in variants}
    assert base.digest() not in digests and len(digests) == len(variants)
    # the vocabulary changes the output stage but not the layer
    bigger_vocab = gpt_small.model_copy(update={"vocab_size": 2000})
    assert make_key(bigger_vocab, StageKind.BLOCK, **ARGS) == base
    assert make_key(bigger_vocab, StageKind.OUTPUT, **ARGS) != make_key(gpt_small, StageKind.OUTPUT, **ARGS)


def test_code_version_follows_the_module_source(tmp_path, monkeypatch):
    from echo_plan.trace import keys

    before = keys.code_version()
    assert before == keys.code_version()
    copy = tmp_path / "trace"
    copy.mkdir()
    for name in keys.TRACED_MODULES:
        (copy / name).write_bytes((keys.Path(keys.__file__).parent / name).read_bytes())
    (copy / "block.py").write_text((copy / "block.py").read_text() + "\n# edited\n")
    monkeypatch.setattr(keys, "__file__", str(copy / "keys.py"))
    assert keys.code_version() != before


def test_every_module_that_defines_traced_ops_is_part_of_the_code_version():
    """A module registering custom ops decides what a trace records: editing it must invalidate the cache."""
    from echo_plan.trace import keys

    here = keys.Path(keys.__file__).parent
    defining = {p.name for p in here.glob("*.py") if "torch.library.custom_op" in p.read_text()}
    in_process_only = {"sparsify.py"}  # its kernels' records are memoised per process, never in the trace cache
    assert defining and defining - in_process_only <= set(keys.TRACED_MODULES)


def test_concurrent_writers_leave_one_whole_file(tmp_path, gpt_small):
    from concurrent.futures import ThreadPoolExecutor

    trace = trace_stage(gpt_small, StageKind.OUTPUT, **ARGS)
    caches = [TraceCache(tmp_path) for _ in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda c: c.put(trace), caches))
    assert [p.name for p in tmp_path.iterdir()] == [TraceCache(tmp_path).path_for(trace.key).name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = TraceCache(tmp_path).get(trace.key)
    assert got is not None and got.ops == trace.ops


def test_deeply_nested_entry_is_discarded_and_retraced(tmp_path, gpt_small):
    cache = TraceCache(tmp_path)
    good = trace_stage(gpt_small, StageKind.EMBEDDING, cache=cache, **ARGS)
    path = cache.path_for(good.key)
    path.write_text('{"a":' + "[" * 100_000 + "]" * 100_000 + "}\n{}")
    fresh = TraceCache(tmp_path)
    with pytest.warns(TraceCacheWarning):
        again = trace_stage(gpt_small, StageKind.EMBEDDING, cache=fresh, **ARGS)
    assert again.ops == good.ops and fresh.corrupt == 1
    assert TraceCache(tmp_path).get(good.key) is not None  # replaced by a good entry


def test_a_folder_in_the_way_is_reported_once_and_bypassed(tmp_path, gpt_small):
    cache = TraceCache(tmp_path)
    good = trace_stage(gpt_small, StageKind.EMBEDDING, cache=cache, **ARGS)
    path = cache.path_for(good.key)
    path.unlink()
    path.mkdir()
    (path / "keep").write_text("not ours")
    fresh = TraceCache(tmp_path)
    with pytest.warns(TraceCacheWarning) as record:
        first = trace_stage(gpt_small, StageKind.EMBEDDING, cache=fresh, **ARGS)
        second = TraceCache.get(fresh, good.key)  # kept in memory for this run
    assert len(record) == 1 and "not using it" in str(record[0].message)
    assert first.ops == good.ops and second is not None
    assert path.is_dir() and (path / "keep").read_text() == "not ours"  # never removed


def test_cli_prints_the_cache_warning_as_one_plain_line(tmp_path, capsys):
    from echo_plan.cli import main

    args = ["trace", "-m", "gpt-13b", "--tp", "8", "--stage", "embedding", "--cache-dir", str(tmp_path)]
    assert main(args) == 0
    entry = next(tmp_path.glob("embedding-*.json"))
    entry.write_bytes(b"\x00garbage")
    capsys.readouterr()
    assert main(["simulate", "-m", "gpt-13b", "--gpus", "8", "--tp", "8", "--cache-dir", str(tmp_path)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "trace cache" in line]
    assert len(err) == 1 and err[0].startswith("warning: trace cache: discarding ")
    assert ".py:" not in err[0]
