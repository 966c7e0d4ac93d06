"""Making the calibration shipped in ``clusters/*.yaml`` from the public measurements.

    python -m echo_plan.calibrate.presets           # refit and print the blocks
    python -m echo_plan.calibrate.presets --write   # and write them into the preset files

``calibrate/blocks.py`` fits the figures by the recipes; each preset's ranges are the
leave-one-suite-out residuals of every suite on its GPU generation (``calibrate/loso.py``). Each
preset file keeps its hand-written part; the block after ``MARKER`` is replaced. ``echo-plan
validate`` then holds every preset against the rows it was not fitted on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from echo_plan.calibrate.blocks import build_blocks
from echo_plan.calibrate.loso import leave_one_suite_out, pooled_ranges
from echo_plan.calibrate.preset_files import MARKER, file_block, write_block
from echo_plan.specs.presets import clusters_dir
from echo_plan.trace.cache import TraceCache
from echo_plan.validation.megatron import validation_dir

__all__ = ["MARKER", "shipped_blocks", "write_block", "main"]

MAX_PASSES = 3  # refits on the written files until the files hold what a refit makes (main)


def shipped_blocks(vdir: Path, cache: Any = None, progress=None) -> dict[str, dict[str, Any]]:
    """Preset name -> its whole calibration block: the fitted figures, and ranges pooled from every suite
    in ``vdir`` predicted without itself."""
    blocks = build_blocks(vdir, cache, progress)
    paths = sorted(vdir.glob("*.csv"))
    suites = leave_one_suite_out(paths, vdir, cache, (lambda m: progress(0, m)) if progress else None)
    for preset, block in blocks.items():
        fam = next((s.family for s in suites if preset in s.family), None)
        if fam is not None:
            block["ranges"] = pooled_ranges(suites, fam).as_json()
    return blocks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write the blocks into clusters/*.yaml")
    ap.add_argument("--validation-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    vdir = args.validation_dir or validation_dir()
    blocks = shipped_blocks(vdir, TraceCache(None), progress=lambda i, m: print(f"  {m}", flush=True))
    for preset, block in sorted(blocks.items()):
        c = block.get("compute", {})
        print(f"{preset}: " + ", ".join(f"{k} {c[k]}" for k in ("gemm_efficiency_scale", "attention_efficiency_scale",
                                                               "memory_bandwidth_scale", "kernel_overhead_us") if k in c))
    if not args.write:
        return 0
    # The suites no recipe is fitted on are predicted, left out, by the presets as the files ship them, and a preset
    # may take another's figures by calibration.from: written once, the ranges may still hold residuals of the figures
    # the files had before. Refitted on the written files until nothing changes (the fits do not read the ranges).
    for attempt in range(1, MAX_PASSES + 1):
        if all(_as_written(block) == file_block(clusters_dir() / f"{preset}.yaml") for preset, block in blocks.items()):
            print(f"the presets in {clusters_dir()} hold these blocks")
            return 0
        for preset, block in sorted(blocks.items()):
            write_block(clusters_dir() / f"{preset}.yaml", block)
        print(f"wrote {len(blocks)} presets in {clusters_dir()} (pass {attempt})")
        blocks = shipped_blocks(vdir, TraceCache(None), progress=lambda i, m: print(f"  {m}", flush=True))
    print(f"the ranges still moved after {MAX_PASSES} passes: run it again", file=sys.stderr)
    return 1


def _as_written(block: dict[str, Any]) -> dict[str, Any]:
    """``block`` as a preset file reads back once written (YAML's lists for tuples, its numbers)."""
    return yaml.safe_load(yaml.safe_dump(block, sort_keys=False))


if __name__ == "__main__":
    raise SystemExit(main())
