"""The images a request or a run sends: stored once under the server's output root, by their content."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tpugen.config.images import image_problem
from tpugen.errors import InputError
from tpugen.outputs.files import atomic_write_bytes


def store_input_image(output_root: Path, data: bytes, where: str) -> tuple[str, str]:
    """(path, sha256) of an image a request sent, written once under the output root by its content; an
    InputError naming `where` if it is no image tpugen can use."""
    problem = image_problem(data)
    if problem:
        raise InputError(f"{where}: {problem}" if not problem.startswith("not") else f"{where}: is {problem}")
    digest = hashlib.sha256(data).hexdigest()
    path = output_root / ".inputs" / f"{digest}.img"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
    return str(path), digest


def data_uri_bytes(value, where: str) -> bytes:
    """The bytes of a run's image sent as a base64 data: URI (data:[TYPE];base64,DATA); InputError naming `where`
    for anything else, a path above all."""
    import base64
    import binascii

    header, comma, payload = value.partition(",") if isinstance(value, str) else ("", "", "")
    if not (header.startswith("data:") and header.endswith(";base64") and comma):
        raise InputError(f"{where}: send the image itself (a base64 data: URI); the server reads no paths")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{where}: the data: URI's base64 does not decode") from None
