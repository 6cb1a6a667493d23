"""LoRA files at the door: where each is, that it is a LoRA for the model's family, its scale, and its hashes."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tpugen.config.images import shipped_name_problem
from tpugen.config.schema import LoraConfig, RunConfig
from tpugen.errors import InputError
from tpugen.families import FAMILIES
from tpugen.models import hub_failure, is_hub_id
from tpugen.settings import cache_root

# What diffusers saves a LoRA as, and looks for first in a folder or a hub repo.
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_MAX_HEADER = 100_000_000  # the safetensors format's own limit on its JSON header


@dataclass(frozen=True)
class Lora:
    """A LoRA resolved: its file on this machine, the scale it is fused at, and its hashes."""

    name: str  # the file's stem: what <lora:NAME:SCALE> and the web UI call it
    id: str  # as the config gave it: a path relative to the config file stays relative, a hub repo id stays one
    path: str  # the .safetensors file on this machine, absolute: what loading reads, and nothing records
    scale: float
    sha256: str  # of the whole file: names exactly what is fused (tensors, and metadata diffusers reads)
    short_hash: str  # the web UI's: 12 hex digits of the sha256 of the tensor data after the header
    from_hub: bool = False  # the id is a hub repo, which every machine downloads for itself

    def record(self) -> dict:
        """How images, manifests, reports and the server's replies name it: by its id as given, or by its file's
        name where the id is a path on this machine (absolute, or under ~), and by its content (sha256)."""
        return {
            "name": self.name,
            "id": recorded_id(self.id, self.path),
            "scale": self.scale,
            "hash": self.short_hash,
            "sha256": self.sha256,
        }


def recorded_id(lora_id: str, path: str) -> str:
    """A LoRA's id as records give it: never a machine path (an absolute or ~ id is named by its file)."""
    return Path(path).name if lora_id.startswith("~") or Path(lora_id).is_absolute() else lora_id


def loras_key(loras) -> tuple:
    """Equal for two LoRA sets that give the same weights: the same files at the same scales, in any order
    (tpugen fuses them in this order, so the order given never changes a bit)."""
    return tuple(sorted((lora.sha256, float(lora.scale)) for lora in loras))


def loras_by_content(loras: list[dict]) -> list[dict]:
    """model.loras (as a config's dict holds them) by what is fused: each file's sha256 (its id where a run from
    before sha256s lacks one) and scale, in one order: what the config hash and a resume's comparison count."""
    named = [{"sha256": lora.get("sha256") or lora.get("id"), "scale": lora.get("scale", 1.0)} for lora in loras]
    return sorted(named, key=lambda lora: (lora["sha256"] or "", lora["scale"]))


# ---------------------------------------------------------------- reading a file


def safetensors_header(path: Path) -> dict | None:
    """The JSON header of a .safetensors file (tensor name -> dtype, shape, offsets), or None if it is not one."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return None
            (length,) = struct.unpack("<Q", head)
            if not 2 <= length <= _MAX_HEADER or length + 8 > os.fstat(handle.fileno()).st_size:
                return None
            header = json.loads(handle.read(length))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return header if isinstance(header, dict) else None


@functools.lru_cache(maxsize=64)
def _hashes(path: str, size: int, mtime_ns: int) -> tuple[str, str]:
    """(sha256 of the file, sha256 of its tensor data), read once; cached while the file is unchanged."""
    whole, data = hashlib.sha256(), hashlib.sha256()
    with open(path, "rb") as handle:
        head = handle.read(8)
        whole.update(head + handle.read(struct.unpack("<Q", head)[0]))
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            whole.update(chunk)
            data.update(chunk)
    return whole.hexdigest(), data.hexdigest()


def file_hashes(path: Path) -> tuple[str, str]:
    """(the whole file's sha256, the web UI's short hash). The short hash is what AUTOMATIC1111's web UI writes
    in `Lora hashes:`: the first 12 hex digits of kohya's "addnet" hash, a sha256 of everything after the header,
    so that editing a file's metadata keeps its name on image sites."""
    stat = path.stat()
    whole, data = _hashes(str(path), stat.st_size, stat.st_mtime_ns)
    return whole, data[:12]


def is_lora_key(key: str) -> bool:
    # Every LoRA format names its factors with "lora": lora_A/lora_B (PEFT), lora.down (diffusers' old),
    # lora_unet_*/lora_te_* with lora_down/lora_up/alpha (kohya); diffusers refuses keys without it.
    return "lora" in key.lower()


# ---------------------------------------------------------------- which family a LoRA is for


def lora_families(keys: list[str]) -> tuple[set[str], str]:
    """The families a LoRA's keys say it can be for, and the evidence; every family when they do not say.

    Each family lists the signs its LoRAs may show (tpugen.families.base.LoraSign); a file showing a sign a
    family lacks is not for that family. A sign that another sign the file shows implies says nothing of its own
    (kohya's Flux block names start lora_unet_ as a UNet's do): a family need not list it."""
    signs = {sign.evidence: sign for f in FAMILIES.values() for sign in f.lora_signs}
    shown = [sign for sign in signs.values() if any(sign.test(key) for key in keys)]
    implied = {evidence for sign in shown for evidence in sign.implies}
    told = {sign.evidence for sign in shown} - implied
    families = {name for name, f in FAMILIES.items() if told <= {s.evidence for s in f.lora_signs}}
    evidence = " and ".join(sign.evidence for sign in shown if sign.evidence not in implied)
    return (families or set(FAMILIES)), evidence


def _titles(families: set[str]) -> str:
    return " or ".join(FAMILIES[name].title for name in FAMILIES if name in families)


# ---------------------------------------------------------------- where a LoRA is


def _hub_file(repo: str, filename: str, where: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename))
    except Exception as exc:  # any hub failure is one line naming the LoRA
        why = hub_failure(exc, what="file", file=filename)
        if why.startswith("the repo has no file"):
            why += " (set weight_name)"
        raise InputError(f"{where}.id: cannot fetch {filename!r} from {repo!r}: {why}") from None


def _in_folder(folder: Path, weight_name: str | None, where: str) -> Path:
    if weight_name:
        return folder / weight_name
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return files[0]
    if (folder / DEFAULT_WEIGHT_NAME).is_file():
        return folder / DEFAULT_WEIGHT_NAME
    found = ", ".join(f.name for f in files[:5]) or "none"
    raise InputError(f"{where}.weight_name: {str(folder)!r} holds {len(files)} .safetensors files ({found}); name one")


def is_hub_lora(lora_id: str) -> bool:
    """Whether a LoRA id that is no file here names a hub repo (org/name; a .safetensors name is a file)."""
    return is_hub_id(lora_id) and not lora_id.endswith(".safetensors")


def in_run_dir(base_dir: Path) -> bool:
    """Whether `base_dir` is a run directory (tpugen.engine.session writes run.json there first; a run from before
    run.json has config.yaml and a manifest): a config resolved there is the run's own (its config.yaml, or the
    copy a rank resolves), whose relative LoRA ids are relative to the config the run started from."""
    if (base_dir / "run.json").is_file():
        return True
    return (base_dir / "config.yaml").is_file() and (base_dir / "manifest.jsonl").is_file()


def _working_dir() -> tuple[Path, ...]:
    try:
        return (Path.cwd(),)
    except OSError:  # the working directory was removed
        return ()


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(child for child in folder.iterdir() if child.is_dir())
    except OSError:
        return []


def _beside_run(lora_id: str, weight_name: str | None, sha256: str, run_dir: Path) -> Path | None:
    """The file a run's relative LoRA id names, found by its content: the run directory does not say where the
    config it started from was, so the id is looked for from the run directory, each folder above it and the
    working directory, and from each of their subfolders (a configs/ beside outputs/), and a file is taken only
    if its sha256 is the one the run pinned. Moving the folder that holds the config, the LoRA and the outputs
    keeps it found."""
    seen: set[Path] = set()
    for root in (run_dir, *run_dir.parents, *_working_dir()):
        for folder in (root, *_subfolders(root)):
            candidate = folder / lora_id
            if candidate in seen or not candidate.exists():
                continue
            seen.add(candidate)
            try:
                path = _in_folder(candidate, weight_name, "") if candidate.is_dir() else candidate
                if path.is_file() and file_hashes(path)[0] == sha256:
                    return path.resolve()
            except (InputError, OSError, struct.error):
                continue
    return None


def _known_file(sha256: str) -> Path:
    return cache_root() / "lora-files" / sha256


def remember(sha256: str, path: Path) -> None:
    """Note where this machine found the LoRA file with this sha256 (a line in tpugen's cache), for a run's own
    config resolved later away from the config it started from: a rank's copy, a resume in an output folder
    that is nowhere near the config."""
    entry, text = _known_file(sha256), str(path)
    try:
        if entry.is_file() and entry.read_text(encoding="utf-8") == text:
            return
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = entry.with_name(f".{sha256}.{os.getpid()}.tmp")
        scratch.write_text(text, encoding="utf-8")
        os.replace(scratch, entry)
    except OSError:  # a cache that cannot be written only leaves a later run to search
        pass


def _remembered(sha256: str, file_name: str | None) -> Path | None:
    """The file this machine last found with this sha256, if it is still there with that content and has the
    `file_name` the id gives (a LoRA is named by its file: a copy of the same bytes under another name, which
    another config used, would rename it in a resumed run's records)."""
    try:
        path = Path(_known_file(sha256).read_text(encoding="utf-8"))
        if file_name is not None and path.name != file_name:
            return None
        if path.is_absolute() and path.is_file() and file_hashes(path)[0] == sha256:
            return path
    except (OSError, ValueError, struct.error):
        pass
    return None


def locate(
    lora_id: str, weight_name: str | None, base_dir: Path, where: str, sha256: str | None = None
) -> tuple[Path, bool]:
    """(the LoRA's file, whether it came from the hub): a file, a folder holding one, or a hub repo. A path is
    relative to the config file; in a run directory's own config, relative to the config the run started from
    (found by the pinned `sha256`: where this machine last found that file, else near the run, _beside_run)."""
    candidate = Path(lora_id).expanduser()
    relative = not candidate.is_absolute()
    candidate = base_dir / candidate if relative else candidate
    if candidate.exists():
        path = _in_folder(candidate, weight_name, where) if candidate.is_dir() else candidate
    elif relative and sha256 is not None and in_run_dir(base_dir):
        file_name = Path(weight_name or lora_id).name if weight_name or lora_id.endswith(".safetensors") else None
        found = _remembered(sha256, file_name) or _beside_run(lora_id, weight_name, sha256, base_dir)
        if found is not None:
            return found, False
        if is_hub_lora(lora_id):
            return _hub_file(lora_id, weight_name or DEFAULT_WEIGHT_NAME, where), True
        raise InputError(
            f"{where}.id: no file {lora_id!r} with sha256 {sha256} near the run in {base_dir} (a run's relative LoRA "
            "id is relative to the config it started from); resume with that config: tpugen generate CONFIG "
            f"--resume {base_dir}"
        )
    elif is_hub_lora(lora_id):
        return _hub_file(lora_id, weight_name or DEFAULT_WEIGHT_NAME, where), True
    else:
        raise InputError(f"{where}.id: {str(candidate)!r} does not exist (a path is relative to the config file)")
    if not path.is_file():
        raise InputError(f"{where}.weight_name: {str(path)!r} does not exist")
    return path.resolve(), False


# ---------------------------------------------------------------- one LoRA, checked


def resolve_lora(
    lora: LoraConfig, base_dir: Path, *, family: str | None = None, model: str = "the model", where: str = "model.loras"
) -> Lora:
    """`lora` checked and resolved, or InputError with one line: a missing file, a file that is not a
    safetensors LoRA, a LoRA whose keys say it is for another family than `family`, a sha256 pin that does
    not match. The scale's range is the schema's. Touches only the file system (and the hub for a repo id)."""
    path, from_hub = locate(lora.id, lora.weight_name, base_dir, where, lora.sha256)
    header = safetensors_header(path)
    if header is None:
        raise InputError(
            f"{where}.id: {path.name!r} is not a .safetensors file (tpugen reads LoRAs only in that format)"
        )
    keys = [key for key in header if key != "__metadata__"]
    factors = [key for key in keys if is_lora_key(key)]
    if not factors:
        raise InputError(
            f"{where}.id: {path.name!r} is not a LoRA: none of its {len(keys)} tensors is a LoRA factor "
            "(names like unet.*.lora_A.weight or lora_unet_*.lora_down.weight)"
        )
    families, evidence = lora_families(factors)
    if family is not None and family not in families:
        raise InputError(
            f"{where}.id: {path.stem!r} is a LoRA for {_titles(families)} (its keys have {evidence}), "
            f"and the model {model} is {FAMILIES[family].title}"
        )
    sha256, short_hash = file_hashes(path)
    if lora.sha256 is not None and lora.sha256 != sha256:
        raise InputError(
            f"{where}.sha256: {path.name!r} has sha256 {sha256}, not the {lora.sha256} the config pins (the file changed)"
        )
    if not from_hub:
        remember(sha256, path)
    return Lora(path.stem, lora.id, str(path), lora.scale, sha256, short_hash, from_hub)


def resolve_loras(loras: list[LoraConfig], base_dir: Path, family: str, model: str, problems: list[str]) -> tuple:
    """Every LoRA of model.loras resolved (each id kept as given, its sha256 filled in), problems noted one line each."""
    resolved, seen = [], {}
    for number, lora in enumerate(loras):
        where = f"model.loras[{number}]"
        try:
            entry = resolve_lora(lora, base_dir, family=family, model=model, where=where)
        except InputError as exc:
            problems.extend(exc.lines)
            continue
        if entry.sha256 in seen:
            problems.append(
                f"{where}.id: the same file as model.loras[{seen[entry.sha256]}]; give it once, scales add up"
            )
            continue
        seen[entry.sha256] = number
        lora.sha256 = entry.sha256
        resolved.append(entry)
    return tuple(resolved)


# ---------------------------------------------------------------- LoRA files for other machines

_SHIPPABLE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,123}\.safetensors")


def shipped_loras(config: RunConfig, loras: Sequence[Lora]) -> list[Path]:
    """The LoRA files pod-run ships beside the config it ships: each local file `config` names (its copy of the
    run's config, edited here) is then named by its file name, which the workers find beside that config; the
    sha256 pin stays, so each worker checks what it got, and the config hash (by content) is the run's. A hub
    LoRA stays a hub id: each worker downloads it. InputError: two files of one name, or a name a worker's shell
    would read as something else (gcloud scp hands the remote path to it)."""
    files = {lora.sha256: lora for lora in loras}
    shipped, named, problems = [], {}, []
    for number, entry in enumerate(config.model.loras):
        lora = files.get(entry.sha256)
        if lora is None or lora.from_hub:
            continue
        name = Path(lora.path).name
        where = f"model.loras[{number}].id"
        if problem := shipped_name_problem(where, "LoRA files", name, _SHIPPABLE, named, "model.loras"):
            problems.append(problem)
        else:
            named[name] = number
            entry.id, entry.weight_name = name, None
            shipped.append(Path(lora.path))
    if problems:
        raise InputError(*problems)
    return shipped
