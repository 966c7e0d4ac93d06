"""Launch configs of training frameworks, both ways (DESIGN.md: an ``interop/`` format each way).

* export: a plan, its model and stack as Megatron-LM's ``pretrain_gpt.py`` arguments, a
  Megatron-Bridge override YAML, or a torchtitan TOML (:func:`export_launch`);
* import: a job's command line, YAML or TOML back into model, plan and stack (:func:`import_launch`);
* logs: the step times a running job writes (``logs.py``), for ``calibrate steps --from-log``.
"""

from __future__ import annotations

from pathlib import Path

from echo_plan.errors import EchoPlanError
from echo_plan.files import read_text
from echo_plan.interop.launch.job import (
    CannotExpress, CannotImport, LaunchExport, LaunchFormat, LaunchJob, canonical_plan, launch_format,
)
from echo_plan.interop.launch.megatron_bridge import export_megatron_bridge, import_megatron_bridge
from echo_plan.interop.launch.megatron_lm import (
    export_megatron_lm, import_argument_dump, import_megatron_lm, parse_argument_dump,
)
from echo_plan.interop.launch.torchtitan import export_torchtitan
from echo_plan.interop.launch.torchtitan_import import import_torchtitan
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec

__all__ = ["CannotExpress", "CannotImport", "LaunchExport", "LaunchFormat", "LaunchJob", "canonical_plan",
           "export_launch", "first_exportable", "import_launch", "launch_format", "read_launch"]

_EXPORTERS = {LaunchFormat.MEGATRON_LM: export_megatron_lm, LaunchFormat.MEGATRON_BRIDGE: export_megatron_bridge,
              LaunchFormat.TORCHTITAN: export_torchtitan}
_IMPORTERS = {LaunchFormat.MEGATRON_LM: import_megatron_lm, LaunchFormat.MEGATRON_BRIDGE: import_megatron_bridge,
              LaunchFormat.TORCHTITAN: import_torchtitan}


def export_launch(fmt: LaunchFormat, model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec,
                  cluster: ClusterSpec) -> LaunchExport:
    """The launch config of ``plan`` in ``fmt``; CannotExpress (one line) when the framework cannot run it as simulated."""
    return _EXPORTERS[fmt](model, plan, stack, cluster)


def first_exportable(fmt: LaunchFormat, model: ModelSpec, plans: list[PlanSpec], stack: SoftwareSpec,
                     cluster: ClusterSpec) -> tuple[int, PlanSpec, LaunchExport, list[str]]:
    """The fastest of ``plans`` (fastest first) that ``fmt`` runs as simulated: (its rank from 1, the plan, its
    export, why each faster one was passed over). CannotExpress when none can (the first plan's reason)."""
    skipped: list[str] = []
    first: CannotExpress | None = None
    for k, plan in enumerate(plans, start=1):
        try:
            return k, plan, export_launch(fmt, model, plan, stack, cluster), skipped
        except CannotExpress as exc:
            first = first or exc
            skipped.append(f"rank {k} ({plan.short()}): {exc.knob} {exc.value}")
            if exc.knob == "model":  # the same for every plan
                break
    assert first is not None, "no plans given"
    raise first


def detect_format(text: str, name: str) -> LaunchFormat:
    suffix = Path(name).suffix.lower()
    if suffix == ".toml":
        return LaunchFormat.TORCHTITAN
    if suffix in (".yaml", ".yml"):
        return LaunchFormat.MEGATRON_BRIDGE
    return LaunchFormat.MEGATRON_LM


def import_launch(text: str, source: str, base_stack: SoftwareSpec, *, fmt: LaunchFormat | None = None,
                  gpus: int | None = None) -> LaunchJob:
    """The job a launch config describes (format from ``fmt`` or the source's suffix); a Megatron-LM log's
    argument dump is read as its command line."""
    fmt = fmt or detect_format(text, source)
    if fmt is LaunchFormat.MEGATRON_LM:
        dump = parse_argument_dump(text)
        if dump is not None:
            return import_argument_dump(dump, source, base_stack)
    return _IMPORTERS[fmt](text, source, base_stack, gpus)


def read_launch(file_or_args: str, base_stack: SoftwareSpec, *, fmt: LaunchFormat | None = None,
                gpus: int | None = None) -> LaunchJob:
    """A launch config from a file, or (when no such file exists and it looks like flags) a command line itself."""
    path = Path(file_or_args)
    looks_like_args = file_or_args.lstrip().startswith("-") or " --" in file_or_args
    if not looks_like_args and not path.exists():
        raise EchoPlanError(f"{file_or_args}: no such file (give a launch file, or the command line in quotes)")
    if looks_like_args and not path.exists():
        return import_launch(file_or_args, "command line", base_stack, fmt=fmt or LaunchFormat.MEGATRON_LM, gpus=gpus)
    return import_launch(read_text(path), str(path), base_stack, fmt=fmt, gpus=gpus)
