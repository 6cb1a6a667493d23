"""Gathering a worker's folder: where its copy lands, and how it is folded into worker-i with no image unlisted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tpugen.modes.pod.names import WORKER_RUN


def gathering_folder(local_run: Path, worker: int) -> Path:
    """Where worker i's folder is copied before it joins OUTPUT_DIR/RUN_ID/worker-i: a failed copy never
    costs the earlier one."""
    return local_run / f".worker-{worker}.gathering"


def folding_folder(local_run: Path, worker: int) -> Path:
    """A whole gathered copy of worker i while it is folded into worker-i: one left behind (a crash mid-fold)
    is folded in before that worker is gathered again; a `.gathering` one may be a torn copy and is dropped."""
    return local_run / f".worker-{worker}.folding"


def adopt_gathered(fresh: Path, folder: Path) -> None:
    """Fold a worker's newly gathered copy into its folder: files only the earlier copy holds stay (a worker
    recreated with a fresh disk has lost the images it made before), every file both hold comes from the
    new copy, and the manifests are joined by image index with the new copy's records winning."""
    if not folder.exists():
        fresh.rename(folder)
        return
    folding = fresh.with_suffix(".folding")  # .worker-i.gathering -> .worker-i.folding: known to be whole
    fresh.rename(folding)
    fold_in(folding, folder)


def fold_in(folding: Path, folder: Path) -> None:
    """Move each file of `folding` into `folder` in whole, then write the joined manifest, then drop
    `folding`: done again after a crash part way, it finishes the same fold, and no image ends up unlisted."""
    from tpugen.outputs.manifest import read_manifest, rewrite_manifest

    manifest = Path(WORKER_RUN, "manifest.jsonl")
    for source in sorted(folding.rglob("*")):
        relative = source.relative_to(folding)
        if source.is_dir() or relative == manifest:
            continue
        target = folder / relative
        if target.is_dir():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
    if (folding / manifest).exists():
        records = {r["index"]: r for r in read_manifest(folder / manifest)} if (folder / manifest).exists() else {}
        records.update({r["index"]: r for r in read_manifest(folding / manifest)})
        rewrite_manifest(folder / WORKER_RUN, records)
    shutil.rmtree(folding)
