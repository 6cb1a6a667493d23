"""Textual-inversion embeddings at the door: each file found, read as diffusers' loader will read it, named by its
stem as the web UI names it, checked for the model's CLIP text encoders, and hashed."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tpugen.config.images import shipped_name_problem
from tpugen.config.loras import safetensors_header
from tpugen.errors import InputError
from tpugen.families import Family
from tpugen.families.prompt_syntax import CHUNK_TOKENS

SUFFIXES = (".safetensors", ".pt", ".bin")  # what the web UI's folder and diffusers' loader read (not its PNGs)
# An embedding is small (75 vectors of SDXL's 2048 values in float32 are 600 KiB); a bigger file is refused by its
# size before a byte of it is read.
MAX_BYTES = 32 << 20
# A prompt names an embedding by its file's stem, which becomes tokens of the tokenizer: a word, no brackets,
# colons or spaces the prompt syntax or the tokenizer would read otherwise.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
# The tensors of an embedding for each of SDXL's two CLIP encoders, in the order of its tokenizers.
SDXL_KEYS = ("clip_l", "clip_g")
_FLOATS = {"F16", "BF16", "F32", "F64"}


@dataclass(frozen=True)
class Embedding:
    """An embedding file, checked: the word prompts name it by, its file, its content and its size."""

    name: str  # the file's stem: what a prompt writes, as in the web UI
    path: str  # the file on this machine, absolute (a link keeps its own name)
    sha256: str  # of the whole file
    vectors: int  # the tokens (and chunk positions) it takes in a prompt
    widths: tuple[int, ...]  # each CLIP encoder's vector width, in the family's tokenizer order (SDXL: clip_l, clip_g)

    @property
    def shape(self) -> int:
        """The web UI's `shape`: the values of one vector (SDXL's: both encoders' together)."""
        return sum(self.widths)

    def token_names(self) -> list[str]:
        """The tokens diffusers' loader adds for it: NAME, NAME_1, ..., one a vector."""
        return [self.name, *(f"{self.name}_{i}" for i in range(1, self.vectors))]


@dataclass(frozen=True)
class SkippedEmbedding:
    """A file of serve.embeddings_dir that did not load, and why (the server starts without it)."""

    name: str
    reason: str
    shape: int | None = None
    vectors: int | None = None


def clip_refusal(family: Family) -> str | None:
    """Why the family's models take no embeddings (None: they do)."""
    if family.clip_tokenizers:
        return None
    return (
        "textual-inversion embeddings are for models whose prompts go through CLIP text encoders alone (Stable "
        f"Diffusion 1.x/2.x and SDXL), and the model is {family.title}"
    )


# ---------------------------------------------------------------- one file


def _sha256(path: Path) -> str:
    status = path.stat()
    return _hash(str(path), status.st_size, status.st_mtime_ns)


@functools.lru_cache(maxsize=128)
def _hash(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _shape(value, what: str) -> tuple[int, ...]:
    if not (isinstance(value, (list, tuple)) and 1 <= len(value) <= 2 and all(isinstance(n, int) for n in value)):
        raise ValueError(f"{what} has shape {value}, not (vectors, width) or (width,)")
    if min(value) < 1:
        raise ValueError(f"{what} is empty (shape {list(value)})")
    return tuple(value)


def _safetensors_layout(path: Path) -> dict[str, tuple[int, ...]]:
    header = safetensors_header(path)
    if header is None:
        raise ValueError("it is not a .safetensors file")
    tensors = {key: value for key, value in header.items() if key != "__metadata__"}
    for key, value in tensors.items():
        if not isinstance(value, dict) or value.get("dtype") not in _FLOATS:
            raise ValueError(f"its tensor {key!r} holds no floating-point values")
    return {key: _shape(value.get("shape"), f"its tensor {key!r}") for key, value in tensors.items()}


def _torch_layout(path: Path) -> dict[str, tuple[int, ...]]:
    """A .pt/.bin as diffusers' loader reads it: a tensor, a mapping of one tensor, or the web UI's
    string_to_param["*"]; or SDXL's clip_l and clip_g."""
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any failure to unpickle is the file's
        raise ValueError(f"it is not a PyTorch file of tensors alone ({type(exc).__name__})") from None

    def tensor(value, what: str) -> tuple[int, ...]:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ValueError(f"{what} is no tensor of floating-point values")
        return _shape(list(value.shape), what)

    if isinstance(data, torch.Tensor):
        return {"": tensor(data, "its tensor")}
    if not isinstance(data, dict):
        raise ValueError(f"it holds a {type(data).__name__}, not tensors")
    if set(SDXL_KEYS) <= set(data):
        return {key: tensor(data[key], f"its {key!r}") for key in SDXL_KEYS}
    if len(data) == 1:
        ((key, value),) = data.items()
        return {str(key): tensor(value, f"its {str(key)!r}")}
    params = data.get("string_to_param")
    if isinstance(params, dict) and "*" in params:
        return {"*": tensor(params["*"], "its string_to_param['*']")}
    raise ValueError(
        f"its {len(data)} entries are neither one tensor, the web UI's string_to_param, nor clip_l and clip_g"
    )


def read_embedding(path: Path, family: Family, *, where: str, model: str = "the model") -> Embedding:
    """The embedding in `path` for a model of `family`, or InputError in one line naming `where`: a file that is
    not a regular one, too big, of another kind, no embedding, or one for other text encoders."""
    path = Path(os.path.abspath(path))
    shown = path.name
    try:
        status = os.stat(path)
    except OSError as exc:
        raise InputError(f"{where}: {str(path)!r} cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(status.st_mode):
        raise InputError(f"{where}: {shown!r} is not a file")
    if path.suffix.lower() not in SUFFIXES:
        raise InputError(f"{where}: {shown!r} is not an embedding file (.safetensors, .pt or .bin)")
    if status.st_size > MAX_BYTES:
        raise InputError(
            f"{where}: {shown!r} is {status.st_size / 2**20:.0f} MiB; an embedding file is at most "
            f"{MAX_BYTES >> 20} MiB (left unread)"
        )
    name = path.stem
    if not NAME.fullmatch(name):
        raise InputError(
            f"{where}: {shown!r}: a prompt names an embedding by its file's stem, which must be letters, digits, "
            "'.', '_' and '-' (rename the file)"
        )
    try:
        layout = _safetensors_layout(path) if path.suffix.lower() == ".safetensors" else _torch_layout(path)
    except ValueError as exc:
        raise InputError(f"{where}: {shown!r} is not a textual-inversion embedding: {exc}") from None
    if not layout:
        raise InputError(f"{where}: {shown!r} is not a textual-inversion embedding: it holds no tensors")
    keys = ("clip_l and clip_g", "one tensor")
    sdxl_file = set(SDXL_KEYS) <= set(layout)
    if len(family.clip_tokenizers) == 2:  # SDXL: a tensor for each encoder
        if not sdxl_file:
            raise InputError(
                f"{where}: {shown!r} is an embedding for one CLIP text encoder (Stable Diffusion 1.x/2.x), and the "
                f"model {model} is {family.title}, whose embeddings hold {keys[0]} tensors"
            )
        shapes = [layout[key] for key in SDXL_KEYS]
    elif sdxl_file:
        raise InputError(
            f"{where}: {shown!r} is an embedding for SDXL (clip_l and clip_g tensors), and the model {model} is "
            f"{family.title}"
        )
    elif len(layout) != 1:
        raise InputError(
            f"{where}: {shown!r} is not a textual-inversion embedding: its {len(layout)} tensors are neither one "
            "embedding nor clip_l and clip_g"
        )
    else:
        shapes = list(layout.values())
    counts = {shape[0] if len(shape) == 2 else 1 for shape in shapes}
    if len(counts) != 1:
        raise InputError(f"{where}: {shown!r} holds {' and '.join(map(str, sorted(counts)))} vectors for its encoders")
    (vectors,) = counts
    if vectors > CHUNK_TOKENS:
        raise InputError(
            f"{where}: {shown!r} has {vectors} vectors; a prompt's chunk holds {CHUNK_TOKENS} tokens, so at most that"
        )
    return Embedding(name, str(path), _sha256(path), vectors, tuple(shape[-1] for shape in shapes))


def name_clashes(embeddings: Sequence[Embedding], where_of) -> list[tuple[int, str]]:
    """(index, why) for each embedding a prompt could not tell from another: a name given twice, or a name that is
    another's NAME_N token (diffusers' loader names a multi-vector embedding's tokens NAME, NAME_1, ...).
    `where_of(i)` names the i-th."""
    clashes, seen = [], {}
    names = {e.name for e in embeddings}
    for number, embedding in enumerate(embeddings):
        if embedding.name in seen:
            clashes.append((number, f"{where_of(seen[embedding.name])} is named {embedding.name!r} too"))
            continue
        seen[embedding.name] = number
        base, _, digits = embedding.name.rpartition("_")
        if digits.isdigit() and base in names:
            clashes.append(
                (
                    number,
                    f"{embedding.name!r} reads as vector {digits} of the embedding {base!r} (diffusers names a "
                    f"multi-vector embedding's tokens {base}, {base}_1, ...); rename the file",
                )
            )
    return clashes


# ---------------------------------------------------------------- model.embeddings


def resolve_embeddings(
    paths: list[str], base_dir: Path, family: Family, model: str, problems: list[str]
) -> tuple[Embedding, ...]:
    """Every file of model.embeddings read and checked (each entry made an absolute path, in place), problems
    noted one line each. A path is relative to the config file."""
    if not paths:
        return ()
    refusal = clip_refusal(family)
    if refusal:
        problems.append(f"model.embeddings: {refusal}")
        return ()
    found: list[Embedding] = []
    numbers: list[int] = []
    for number, text in enumerate(paths):
        where = f"model.embeddings[{number}]"
        path = Path(text).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.exists():
            problems.append(f"{where}: {str(path)!r} does not exist (a path is relative to the config file)")
            continue
        try:
            embedding = read_embedding(path, family, where=where, model=model)
        except InputError as exc:
            problems.extend(exc.lines)
            continue
        paths[number] = embedding.path
        found.append(embedding)
        numbers.append(number)

    def where_of(index: int) -> str:
        return f"model.embeddings[{numbers[index]}]"

    problems.extend(f"{where_of(i)}: {why}" for i, why in name_clashes(found, where_of))
    return tuple(found)


def embeddings_by_content(embeddings: Sequence[Embedding]) -> list[dict]:
    """What the config hash counts of model.embeddings: each one's name (the word prompts write) and content, in
    one order (the order they are loaded in changes no image)."""
    return sorted(({"name": e.name, "sha256": e.sha256} for e in embeddings), key=lambda e: (e["name"], e["sha256"]))


# ---------------------------------------------------------------- serve.embeddings_dir


def _shown_name(name: str) -> str:
    """A file's stem as a reply may show it: as it is if it is a name, else escaped (no control characters, and
    no undecodable bytes, which JSON cannot carry)."""
    return name if NAME.fullmatch(name) else ascii(name)[1:-1][:140]


def folder_embeddings(
    folder: str, family: Family, model: str = "the model"
) -> tuple[list[Embedding], list[SkippedEmbedding]]:
    """The embedding files of serve.embeddings_dir, read and checked (loaded, skipped); a file that fails is
    skipped, saying why. Read safely: only files named *.safetensors, *.pt or *.bin (any case); a link whose target
    is outside the folder is ignored; a file that is not a regular one, or bigger than MAX_BYTES, is skipped
    unread; a name a prompt could not write is skipped."""
    root = Path(folder).resolve()
    try:
        names = sorted(entry.name for entry in os.scandir(root))
    except OSError as exc:
        return [], [SkippedEmbedding("", f"serve.embeddings_dir cannot be read ({exc.strerror or exc})")]
    found: list[Embedding] = []
    skipped: list[SkippedEmbedding] = []
    refusal = clip_refusal(family)
    for file_name in names:
        stem, suffix = os.path.splitext(file_name)
        if suffix.lower() not in SUFFIXES:
            continue
        path = root / file_name
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError):
            skipped.append(SkippedEmbedding(_shown_name(stem), "a link to nothing"))
            continue
        if target != root and root not in target.parents:
            continue  # a link out of the folder: not the folder's file
        if refusal:
            skipped.append(SkippedEmbedding(_shown_name(stem), refusal))
            continue
        try:
            found.append(read_embedding(path, family, where="serve.embeddings_dir", model=model))
        except InputError as exc:
            skipped.append(SkippedEmbedding(_shown_name(stem), exc.lines[0].removeprefix("serve.embeddings_dir: ")))
        except OSError as exc:  # unreadable halfway (its mode, or a change under it): skipped, not fatal
            skipped.append(SkippedEmbedding(_shown_name(stem), f"cannot be read ({exc.strerror or exc})"))
    clashes = dict(name_clashes(found, lambda i: Path(found[i].path).name))
    for number, why in clashes.items():
        embedding = found[number]
        skipped.append(SkippedEmbedding(embedding.name, why, embedding.shape, embedding.vectors))
    return [e for number, e in enumerate(found) if number not in clashes], skipped


# ---------------------------------------------------------------- pod-run

_SHIPPABLE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,123}\.(safetensors|pt|bin)", re.IGNORECASE)


def shipped_embeddings(config, embeddings: Sequence[Embedding], taken: set[str] = frozenset()) -> list[Path]:
    """The embedding files pod-run ships beside the config it ships: `config` (its copy of the run's config,
    edited here) then names each by its file name, which the workers find beside that config. InputError: a name
    a worker's shell would read as something else, or one of the files in `taken` (the LoRAs shipped)."""
    problems = []
    for number, embedding in enumerate(embeddings):
        name = Path(embedding.path).name
        where = f"model.embeddings[{number}]"
        if problem := shipped_name_problem(where, "embedding files", name, _SHIPPABLE, {}, "model.embeddings"):
            problems.append(problem)
        elif name in taken:
            problems.append(
                f"model.embeddings[{number}]: pod-run ships files side by side, and a LoRA file is named {name!r} too; "
                "rename one"
            )
    if problems:
        raise InputError(*problems)
    config.model.embeddings = [Path(e.path).name for e in embeddings]
    return [Path(e.path) for e in embeddings]
