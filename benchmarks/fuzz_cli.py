"""Hostile and absurd input through every command of the CLI, as a user would type it (issue 18).

Generates a few hundred inputs (seeded, so the same ones each run) in the classes the issue
lists: out-of-range and malformed numbers, output paths that are folders, FIFOs, sockets, links,
files used as folders, unwritable or empty paths, malformed / deep / huge / special spec files,
Hugging Face configs with unsupported architecture keys, oversized search spaces and corrupted
trace-cache entries. Each runs as its own ``python -m echo_plan.cli`` process with a time limit;
the benchmark prints, per class and in total: tracebacks, hangs, exit codes other than 0 and 2,
failures without a one-line error, and writes outside the output path it was given. All should
be zero.

Run: .venv/bin/python benchmarks/fuzz_cli.py [--count 300] [--seed 0] [--jobs 4] [--timeout 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = {"name": "tiny", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1024,
        "seq_length": 256}
NUMBERS = ["0", "-1", "-5", "1", "2", "3", "8", "64", "2147483648", str(2**70), "9" * 40, "1e9", "nan", "inf",
           "", "x", "0x10", "1.5", "-0"]
PLAUSIBLE = ["1", "2", "4", "8"]
SIZES = ["1MiB", "64MB", "0", "-5MiB", "1e30", "99PiB", "nan", "inf", "1XB", "9" * 40]
HOSTILE_VALUES = [0, -1, 2**40, 2**200, 1e12, float("inf"), float("nan"), "x", None, True, [1, 2], {"a": 1}, ""]


@dataclass
class Case:
    kind: str
    argv: list[str]
    outputs: list[str] = field(default_factory=list)
    home: Path = Path()  # this case's own folder: its spec files, guarded things and good output paths
    guarded: dict = field(default_factory=dict)  # path -> stat test it must still pass afterwards


@dataclass
class Outcome:
    case: Case
    code: int | None  # None: hung
    traceback: bool
    no_error_line: bool
    stray: list[str]
    seconds: float


class Arena:
    """A temporary folder with things an output must never replace and spec files to mutate."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root
        self.cache = root / "cache"
        self.model = self.write("tiny.yaml", _yaml(TINY))
        self.space = self.write("space.yaml", _yaml({"knobs": {"tp": [1, 2], "pp": [1, 2]}}))
        self.n = 0

    def _make_guards(self) -> dict[Path, object]:
        """Things in this case's folder that no output may replace: a folder, a file, a FIFO, a
        socket and a link to the FIFO (each case has its own, so that cases run in parallel)."""
        self.folder = self.home / "adir"
        self.folder.mkdir()
        self.file = self.write("afile.json", "precious")
        self.fifo = self.home / "fifo.json"
        os.mkfifo(self.fifo)
        self.sock_path = self.home / "sock.csv"
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(self.sock_path))  # the socket file stays after the socket closes
        self.link = self.home / "link.html"
        self.link.symlink_to(self.fifo)
        return {self.fifo: stat.S_ISFIFO, self.sock_path: stat.S_ISSOCK, self.folder: stat.S_ISDIR,
                self.link: stat.S_ISLNK}

    def start_case(self, index: int) -> Path:
        """Cases run in parallel: each writes only in its own folder (and the shared trace cache)."""
        self.home = self.root / "cases" / str(index)
        self.home.mkdir(parents=True)
        self.guarded = self._make_guards()
        return self.home

    def write(self, name: str, text: str) -> Path:
        p = self.home / name
        p.write_text(text, encoding="utf-8", errors="surrogateescape")
        return p

    def spec(self, text: str, suffix: str = ".yaml") -> str:
        self.n += 1
        return str(self.write(f"spec{self.n}{suffix}", text))

    def bad_paths(self, suffix: str) -> list[str]:
        # relative ("\x01bad") and "wrong.txt" land in the case's own folder, where its command runs
        return ["", str(self.folder), str(self.fifo), str(self.sock_path), str(self.link), str(self.file / f"x{suffix}"),
                f"/proc/echo-plan-fuzz/x{suffix}", str(self.home / "wrong.txt"), "/",
                "\x01bad"]

    def good_path(self, suffix: str) -> str:
        self.n += 1
        return str(self.home / "new" / f"out{self.n}{suffix}")

    def snapshot(self, home: Path) -> set[str]:
        """Everything under the arena except the shared trace cache and other cases' folders."""
        cases = self.root / "cases"
        seen = set()
        for dirpath, dirnames, filenames in os.walk(self.root):
            here = Path(dirpath)
            if here == cases:
                dirnames[:] = [d for d in dirnames if cases / d == home]
            if here == self.root and "cache" in dirnames:
                dirnames.remove("cache")
            seen.update(str(here / name) for name in dirnames + filenames)
        return seen


def _yaml(data: object) -> str:
    import yaml

    return yaml.safe_dump(data)


def _cluster(key: str, value: object) -> str:
    import yaml

    data = yaml.safe_load((ROOT / "clusters" / "h800.yaml").read_text())
    *parents, leaf = key.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return yaml.safe_dump(data)


def generate(arena: Arena, count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    base = ["-m", str(arena.model), "--gpus", "8", "--cache-dir", str(arena.cache)]
    search_base = base + ["--space", str(arena.space), "--trials", "2", "--storage", "memory", "--no-progress"]

    def number() -> str:
        return rng.choice(PLAUSIBLE if rng.random() < 0.3 else NUMBERS)

    def out(suffix: str) -> str:
        return arena.good_path(suffix) if rng.random() < 0.3 else rng.choice(arena.bad_paths(suffix))

    def numbers_case() -> Case:
        cmd = rng.choice(["simulate", "search", "comm", "trace", "compare"])
        if cmd == "comm":
            return Case("numbers", ["comm", "--gpus", number(), "-s", rng.choice(SIZES)])
        if cmd == "trace":
            return Case("numbers", ["trace", "-m", str(arena.model), "--tp", number(), "--mbs", number(),
                                    "--cache-dir", str(arena.cache)])
        opts = {"simulate": ["--tp", "--pp", "--dp", "--mbs", "--gbs", "--vpp", "--nodes", "--gpus", "--density",
                             "--ep", "--etp", "--expert-imbalance", "--failures-per-gpu-day", "--restart-min",
                             "--checkpoint-gbps-per-gpu"],
                "search": ["--gbs", "--seed", "--trials", "--top", "--workers", "--gpus"],
                "compare": ["--gbs", "--seed", "--trials", "--price-per-gpu-hour"]}[cmd]
        argv = [cmd] + (search_base if cmd != "simulate" else base)
        if cmd == "compare":
            argv = ["compare", "-m", str(arena.model), "--gpus", rng.choice(["8,16", "0,8", "8," + "9" * 30, "x"]),
                    "--space", str(arena.space), "--trials", "2", "--storage", "memory", "--no-progress",
                    "--cache-dir", str(arena.cache), "--tokens", rng.choice(["300B", "1e40", "-1", "x"])]
        for name in rng.sample(opts, rng.randint(1, 3)):
            argv += [name, number()]
        if cmd == "simulate" and rng.random() < 0.3:  # sparse exchanges and faults take numbers too
            argv += ["--dp-comm", rng.choice(["topk", "exdyna", "gossip", ""])]
        if cmd == "simulate" and rng.random() < 0.3:
            argv += ["--fault", rng.choice([f"straggler:rank={number()},compute={number()}",
                                            f"link:node={number()},nic={number()},bw={number()}",
                                            f"nvlink:node={number()},bw={number()}", f"node:node={number()}",
                                            "x", ":", "straggler:rank=1,rank=1,compute=2"])]
        return Case("numbers", argv)

    def output_case() -> Case:
        cmd = rng.choice(["simulate", "search", "compare", "report", "calibrate-nccl", "export", "collective",
                          "storage"])
        if cmd == "storage":
            p = out(".db")
            return Case("outputs", ["search", "-m", str(arena.model), "--gpus", "8", "--space", str(arena.space),
                                    "--trials", "2", "--no-progress", "--cache-dir", str(arena.cache),
                                    "--storage", f"sqlite:///{p}"], [p])
        if cmd == "simulate":
            p = out(".json")
            return Case("outputs", ["simulate"] + base + ["--trace", p], [p])
        if cmd == "search":
            c, r = out(".csv"), out(".html")
            return Case("outputs", ["search"] + search_base + ["--csv", c, "--report", r], [c, r])
        if cmd == "compare":
            c = out(".csv")
            return Case("outputs", ["compare", "-m", str(arena.model), "--gpus", "8", "--space", str(arena.space),
                                    "--trials", "2", "--storage", "memory", "--no-progress", "--csv", c,
                                    "--cache-dir", str(arena.cache)], [c])
        if cmd == "report":
            p = out(".html")
            return Case("outputs", ["report", str(arena.file), "-o", p, "--no-simulate"], [p])
        if cmd == "calibrate-nccl":
            p = out(".yaml")
            log = ROOT.parent / "shared" / "validation" / "nccl-tests"
            logs = sorted(log.glob("*")) if log.is_dir() else []
            src = str(logs[0]) if logs else str(arena.file)
            return Case("outputs", ["calibrate", "nccl", src, "-c", "azure-nd-a100-v4", "-o", p], [p])
        if cmd == "export":
            p = out("")
            ranks = rng.choice(["0-7", "0,3", "0-99999999999999", "5-2", "x", ""])
            return Case("outputs", ["export", "chakra", "-o", p, "-m", str(arena.model), "--gpus", "8", "--tp", "4",
                                    "--ranks", ranks, "--cache-dir", str(arena.cache)], [p + ".0.et", p + ".comm_groups.json"] +
                        [f"{p}.{r}.et" for r in range(8)])
        p = out("")
        xml = ROOT / "echo_plan" / "data" / "msccl" / "ring_allreduce_8.xml"
        return Case("outputs", ["export", "chakra-collective", str(xml), "-o", p], [f"{p}.{g}.et" for g in range(8)])

    def spec_case() -> Case:
        which = rng.choice(["model", "cluster", "raw", "hf", "space", "stack", "special"])
        if which == "model":
            spec = arena.spec(_yaml({**TINY, rng.choice(list(TINY) + ["bogus"]): rng.choice(HOSTILE_VALUES)}))
            return Case("spec files", ["simulate", "-m", spec, "--gpus", "8", "--cache-dir", str(arena.cache)])
        if which == "cluster":
            key = rng.choice(["gpus_per_node", "num_nodes", "gpu.hbm_GiB", "gpu.peak_bf16_tflops", "gpu.sm_count",
                              "network.nic_bw_Gbps", "network.oversubscription", "calibration.compute.bogus",
                              "calibration.compute.memory_bandwidth_scale", "calibration.nccl"])
            spec = arena.spec(_cluster(key, rng.choice(HOSTILE_VALUES)))
            return Case("spec files", ["simulate", "-c", spec] + base)
        if which == "raw":
            text = rng.choice(["a: " + "[" * 50000 + "]" * 50000, '{"a": ' + "[" * 50000 + "]" * 50000 + "}",
                               '{"num_layers": ' + "9" * 5000 + "}", "\x00\xff\xfe", "a: &x [*x]\n", "- 1\n- 2\n",
                               "name: [1, 2", "", "x" * 100])
            suffix = ".json" if text.startswith("{") else ".yaml"
            return Case("spec files", ["simulate", "-m", arena.spec(text, suffix), "--gpus", "8"])
        if which == "hf":
            cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                   "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 256}
            cfg.update(rng.choice([{"num_local_experts": 8}, {"model_type": "mixtral"}, {"hidden_act": "relu"},
                                   {"sliding_window": 64}, {"head_dim": 7}, {"mlp_bias": True},
                                   {"vocab_size": 10**12}, {"model_type": "t5"}, {}]))
            folder = arena.home / "hf"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(cfg))
            return Case("spec files", ["simulate", "-m", str(folder), "--gpus", "8", "--cache-dir", str(arena.cache)])
        if which == "space":
            knobs = rng.choice([{"tp": list(range(1, 65)), "pp": list(range(1, 65)), "micro_batch_size":
                                 list(range(1, 65)), "virtual_stages": list(range(1, 33))},
                                {"tp": [0]}, {"tp": [2**70]}, {"bogus": [1]}, {"tp": "x"}])
            spec = arena.spec(_yaml({"knobs": knobs}))
            return Case("spec files", ["search", "--space", spec, "-m", str(arena.model), "--gpus", "8",
                                       "--trials", "2", "--storage", "memory", "--no-progress"])
        if which == "stack":
            spec = arena.spec(_yaml({"base": rng.choice(["megatron-core", "nope"]),
                                     rng.choice(["optimizer_state_bytes", "hidden_dropout", "bogus"]):
                                         rng.choice(HOSTILE_VALUES)}))
            return Case("spec files", ["simulate", "--stack", spec] + base)
        target = rng.choice(["/dev/zero", str(arena.fifo), str(arena.folder), str(arena.sock_path), "/proc/self/mem"])
        flag = rng.choice(["-m", "-c", "--stack", "--interference"])
        rest = base[2:] if flag == "-m" else base  # base starts with -m tiny.yaml
        return Case("spec files", ["simulate", flag, target] + rest)

    def cache_case() -> Case:
        cache = arena.home / "cache"
        subprocess.run([sys.executable, "-m", "echo_plan.cli", "trace", "-m", str(arena.model), "--cache-dir",
                        str(cache)], capture_output=True, timeout=120, cwd=ROOT)
        entries = sorted(cache.glob("*.json"))
        if entries:
            victim = rng.choice(entries)
            how = rng.choice(["folder", "deep", "garbage", "truncate", "empty", "fifo"])
            victim.unlink()
            if how == "folder":
                victim.mkdir()
            elif how == "fifo":
                os.mkfifo(victim)
            else:
                victim.write_text({"deep": '{"a":' + "[" * 100000 + "]" * 100000 + "}\n{}", "garbage": "\x00" * 99,
                                   "truncate": '{"format": "echo-plan-trace"', "empty": ""}[how])
        return Case("trace cache", ["simulate", "-m", str(arena.model), "--gpus", "8", "--cache-dir", str(cache)],
                    [str(cache)])

    makers = [numbers_case, output_case, spec_case, cache_case]
    weights = [0.35, 0.3, 0.3, 0.05]
    cases = []
    for i in range(count):
        home = arena.start_case(i)
        case = rng.choices(makers, weights)[0]()
        case.home, case.guarded = home, arena.guarded
        cases.append(case)
    return cases


def run_case(arena: Arena, case: Case, timeout_s: float) -> Outcome:
    before = arena.snapshot(case.home)
    t0 = time.perf_counter()
    env = dict(os.environ, ECHO_PLAN_CACHE_DIR=str(arena.cache), COLUMNS="120")
    try:
        p = subprocess.run([sys.executable, "-m", "echo_plan.cli", *case.argv], capture_output=True, text=True,
                           timeout=timeout_s, cwd=case.home, env=env, stdin=subprocess.DEVNULL)
        code, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as exc:
        code, err = None, (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
    seconds = time.perf_counter() - t0
    lines = err.rstrip().splitlines()
    no_error_line = code == 2 and not (lines and lines[-1].startswith(("error: ", "Error: ")))
    named = [case.home / o for o in case.outputs if o]  # relative paths are relative to the run's folder (its own)
    allowed = {str(o) for o in named} | {str(q) for o in named for q in o.parents}
    after = arena.snapshot(case.home)
    stray = sorted(p for p in after - before
                   if p not in allowed and not any(p.startswith(a + os.sep) for a in allowed))
    stray += [f"replaced {p}" for p, test in case.guarded.items() if not test(os.lstat(p).st_mode)]
    stray += [f"changed {p}" for p in [case.home / "afile.json"] if p.read_text() != "precious"]
    stray += [p for p in after if p.endswith(".tmp")]
    return Outcome(case, code, "Traceback (most recent call last)" in err, no_error_line, stray, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)))
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before an input counts as a hang")
    ap.add_argument("--verbose", action="store_true", help="print every failing input")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo-plan-fuzz-") as tmp:
        arena = Arena(Path(tmp))
        cases = generate(arena, args.count, args.seed)
        t0 = time.perf_counter()
        done = 0
        results: list[Outcome] = []
        with ThreadPoolExecutor(args.jobs) as pool:
            for result in pool.map(lambda c: run_case(arena, c, args.timeout), cases):
                results.append(result)
                done += 1
                if done % 25 == 0 or done == len(cases):
                    print(f"\r  {done}/{len(cases)} inputs", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    report(results, time.perf_counter() - t0)


def report(results: list[Outcome], wall_s: float) -> None:
    by_kind: dict[str, Counter] = defaultdict(Counter)
    failures: list[str] = []
    for r in results:
        c = by_kind[r.case.kind]
        c["inputs"] += 1
        c["hangs" if r.code is None else f"exit {r.code}" if r.code in (0, 2) else "other exit codes"] += 1
        for name, bad in (("tracebacks", r.traceback), ("no one-line error", r.no_error_line),
                          ("stray writes", bool(r.stray))):
            c[name] += int(bad)
        if r.code not in (0, 2) or r.traceback or r.no_error_line or r.stray:
            failures.append(f"  {r.case.kind}: exit {r.code} {' '.join(r.case.argv)[:160]} {r.stray[:2]}")
    cols = ["inputs", "exit 0", "exit 2", "tracebacks", "hangs", "other exit codes", "no one-line error",
            "stray writes"]
    print(f"{'class':<13}" + "".join(f"{c:>18}" for c in cols))
    total = Counter()
    for kind, c in sorted(by_kind.items()):
        total.update({k: c[k] for k in cols})
        print(f"{kind:<13}" + "".join(f"{c[k]:>18}" for k in cols))
    print(f"{'total':<13}" + "".join(f"{total[k]:>18}" for k in cols))
    slowest = max(results, key=lambda r: r.seconds)
    print(f"{len(results)} inputs in {wall_s:.0f} s; slowest {slowest.seconds:.1f} s: {' '.join(slowest.case.argv)[:120]}")
    if failures:
        print("failing inputs:")
        print("\n".join(failures[:40]))
    bad = sum(total[k] for k in ("tracebacks", "hangs", "other exit codes", "no one-line error", "stray writes"))
    print("RESULT: " + ("all zero" if bad == 0 else f"{bad} problems"))


if __name__ == "__main__":
    main()
