"""Model and cluster presets, and loading a spec from a name or a file."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

from echo_plan.files import safe_load

from echo_plan.specs.calibration import INHERITED, USER_INHERITED
from echo_plan.errors import EchoPlanError, UnknownPresetError
from echo_plan.specs.cluster import ClusterSpec
from echo_plan.specs.loaders import is_hf_config, model_fields_from_hf, read_mapping
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.software import SoftwareSpec
from echo_plan.limits import MAX_BYTES

DEFAULT_MODEL = "gpt3-175b"
DEFAULT_CLUSTER = "h800"
DEFAULT_STACK = "megatron-core"


def _preset_dir(folder: str, marker: str) -> Path:
    """``folder/`` at the project root (found upward from this file), else the packaged copy."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / folder
        if candidate.is_dir() and (candidate / marker).exists():
            return candidate
    return Path(str(resources.files("echo_plan") / "data" / folder))


def clusters_dir() -> Path:
    """The folder of cluster presets: ``clusters/`` at the project root."""
    return _preset_dir("clusters", "h800.yaml")


def stacks_dir() -> Path:
    """The folder of software-stack presets: ``stacks/`` at the project root."""
    return _preset_dir("stacks", f"{DEFAULT_STACK}.yaml")


@lru_cache(maxsize=1)
def _model_table() -> dict[str, dict]:
    text = (resources.files("echo_plan") / "data" / "models.yaml").read_text(encoding="utf-8")
    return safe_load(text, packaged=True)


def model_names() -> list[str]:
    return sorted(_model_table())


# Other names of cluster presets: the preset they load (issue 35: `h100` as the GPU's name for `dgx-h100`)
CLUSTER_ALIASES = {"h100": "dgx-h100"}


def cluster_names() -> list[str]:
    return sorted(p.stem for p in clusters_dir().glob("*.yaml"))


def stack_names() -> list[str]:
    return sorted(p.stem for p in stacks_dir().glob("*.yaml"))


def _looks_like_path(ref: str) -> bool:
    return ref.endswith((".yaml", ".yml", ".json")) or "/" in ref or Path(ref).exists()


def load_model(ref: str) -> ModelSpec:
    """A model preset by name, or a YAML/JSON ModelSpec file, or a Hugging Face config.json."""
    if not _looks_like_path(ref):
        table = _model_table()
        if ref not in table:
            raise UnknownPresetError("model", ref, list(table))
        return ModelSpec.build({"name": ref, **table[ref]}, context=f"model preset {ref}")
    if Path(ref).is_dir() and (Path(ref) / "config.json").is_file():  # a Hugging Face model folder
        ref = str(Path(ref) / "config.json")
    data = read_mapping(ref)
    if is_hf_config(data):
        # config.json names its model by its folder (a Hugging Face checkout); any other file by its own name
        name = (Path(ref).parent.name if Path(ref).name == "config.json" else "") or Path(ref).stem
        return ModelSpec.build(model_fields_from_hf(data, name, ref), context=ref)
    data.setdefault("name", Path(ref).stem)
    return ModelSpec.build(data, context=ref)


def load_cluster(ref: str, nodes: int | None = None, gpus: int | None = None) -> ClusterSpec:
    """A cluster preset by name or a YAML/JSON ClusterSpec file, optionally resized."""
    if _looks_like_path(ref):
        path = Path(ref)
    else:
        path = clusters_dir() / f"{CLUSTER_ALIASES.get(ref, ref)}.yaml"
        if not path.exists():
            raise UnknownPresetError("cluster", ref, cluster_names() + sorted(CLUSTER_ALIASES))
    data = read_mapping(path)
    data.setdefault("name", path.stem)
    cal = data.get("calibration")
    if _looks_like_path(ref) or (isinstance(cal, dict) and "from" in cal):  # a preset may name another's too
        data = _with_inherited_calibration(data, str(path), USER_INHERITED if _looks_like_path(ref) else INHERITED)
    cluster = ClusterSpec.build(data, context=str(path))
    return cluster.resized(nodes=nodes, gpus=gpus)


def _preset_calibration(name: str, context: str, seen: tuple[str, ...] = ()) -> dict:
    """A preset's calibration with its own ``from`` resolved (presets may chain; a loop is an error)."""
    if name in seen:
        raise EchoPlanError(f"{context}: calibration.from loops through {' -> '.join(seen + (name,))}")
    cal = dict(read_mapping(clusters_dir() / f"{name}.yaml").get("calibration") or {})
    source = cal.get("from")
    if isinstance(source, str) and source in cluster_names():
        inherited = _preset_calibration(source, context, seen + (name,))
        cal = {**{k: inherited[k] for k in INHERITED if k in inherited}, **{k: v for k, v in cal.items() if k != "from"}}
    return cal


def preset_calibration(name: str) -> dict:
    """A cluster preset's calibration block, with its own ``calibration.from`` resolved."""
    if name not in cluster_names():
        raise UnknownPresetError("cluster", name, cluster_names())
    return _preset_calibration(name, f"cluster preset {name}")


def _gpu_arch(data: dict) -> object:
    gpu = data.get("gpu")
    return gpu.get("sm_arch") if isinstance(gpu, dict) else None


def _with_inherited_calibration(data: dict, context: str, inherited: tuple[str, ...] = USER_INHERITED) -> dict:
    """A cluster file of one's own: ``calibration: {from: PRESET}`` takes that preset's compute figures,
    ranges and host issue time (a preset naming another takes ``inherited``: not the host's, which is the
    server's own; the file's own sections win); with no calibration at all, the preset with the same GPU gives them,
    and ``calibration.from`` says which. A GPU no preset has stays uncalibrated (and says so)."""
    cal = data.get("calibration")
    if isinstance(cal, dict) and isinstance(cal.get("from"), str):
        source = cal["from"]
        if source not in cluster_names():
            raise UnknownPresetError("cluster", source, cluster_names())
        got = _preset_calibration(source, context)
        other_arch = _gpu_arch(read_mapping(clusters_dir() / f"{source}.yaml")) != _gpu_arch(data)
        # another GPU generation: its sustained shares of the kernel model are a prior, not a measurement of this
        # GPU, so its ranges (errors measured on its own runs) are not taken: the uncalibrated ones say how unsure;
        # nor are its figures per kernel family, fitted on that GPU's runs of those stacks beside its compute figures
        # (a file with compute figures of its own, fitted on its own runs, keeps them for every family)
        kinds = tuple(k for k in inherited if not (other_arch and k in ("ranges", "compute_by_kernels"))
                      and not (k == "compute_by_kernels" and "compute" in cal))
        merged = {k: got[k] for k in kinds if k in got}
        merged.update({k: v for k, v in cal.items() if k != "from"})
        taken = ", ".join(k for k in kinds if k in got and k not in cal)
        what = f"{taken}, as named" if taken else "what this preset does not fit itself"
        merged["from"] = (f"{source} ({what}; another GPU generation: a prior, its ranges not taken)"
                          if other_arch else f"{source} ({what})")
        return {**data, "calibration": merged}
    if cal is not None:
        return data
    gpu = data.get("gpu")
    name = gpu.get("name") if isinstance(gpu, dict) else None
    for preset in cluster_names():
        got = read_mapping(clusters_dir() / f"{preset}.yaml")
        pre_gpu = (got.get("gpu") or {}).get("name")
        cal_p = got.get("calibration") or {}
        if name and pre_gpu == name and "compute" in cal_p:
            merged = {k: cal_p[k] for k in inherited if k in cal_p}
            merged["from"] = f"{preset} (same GPU {name}: {', '.join(merged)})"
            return {**data, "calibration": merged}
    return data


def load_stack(ref: str | None = None, overrides: dict | None = None) -> SoftwareSpec:
    """A software-stack preset by name or a YAML/JSON SoftwareSpec file (default: megatron-core).

    A file may start from a preset with ``base: NAME`` and change some fields; ``overrides``
    (field -> value) are applied last, as a validation row applies its own settings."""
    ref = ref or DEFAULT_STACK
    data, root = _stack_mapping(ref, seen=())
    data.update(overrides or {})
    data["base"] = root
    return SoftwareSpec.build(data, context=f"stack {ref}")


def _stack_mapping(ref: str, seen: tuple[str, ...]) -> tuple[dict, str]:
    """The stack's fields with its base's merged in, and the preset at the root of its bases."""
    if _looks_like_path(ref):
        path = Path(ref)
        data = read_mapping(path)
        data.setdefault("name", path.stem)
    else:
        path = stacks_dir() / f"{ref}.yaml"
        if not path.exists():
            raise UnknownPresetError("stack", ref, stack_names())
        data = read_mapping(path)
        data.setdefault("name", ref)
    base = data.pop("base", None)
    if base is None:
        return data, str(data.get("name", ref))
    if not isinstance(base, str) or not base:
        raise EchoPlanError(f"{path}: base must be the name of a stack preset or a stack file, not {base!r}")
    if base in seen or base == ref:
        raise EchoPlanError(f"{path}: base {base!r} refers back to itself")
    merged, root = _stack_mapping(base, seen + (ref,))
    merged.pop("description", None)
    merged.pop("sources", None)
    merged.update(data)
    return merged, root


def parse_size(text: str | int) -> int:
    """Bytes from ``1048576``, ``64MB``, ``1GiB``, ``512K`` (K/M/G/T decimal, KiB/MiB/GiB binary)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if not 0 <= text <= MAX_BYTES:
            raise EchoPlanError(f"size {text!r} is outside 0 B to {MAX_BYTES:,} B (1 PiB)")
        return text
    s = str(text).strip().replace(" ", "")
    units = {
        "": 1, "b": 1,
        "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
        "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    }
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].lower()
    try:
        value = float(num)
    except ValueError:
        raise EchoPlanError(f"size {text!r} is not a number of bytes; use e.g. 1048576, 64MB or 1GiB") from None
    if unit not in units:
        raise EchoPlanError(f"size {text!r} has unknown unit {unit!r}; valid: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    if value < 0:
        raise EchoPlanError(f"size {text!r} must not be negative")
    if value != value or value * units[unit] > MAX_BYTES:  # NaN, or beyond any GPU cluster's memory
        raise EchoPlanError(f"size {text!r} is more than {MAX_BYTES:,} B (1 PiB); no collective or memory is that large")
    return int(round(value * units[unit]))
