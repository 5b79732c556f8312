"""Writing files the safe way: check every target first, so a refusal leaves nothing half-written."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import RecipeError


def make_folder(folder: Path, fix: str) -> None:
    """Make `folder` (and its parents), writable; a file in the way or a folder that cannot be made or
    written is one line ending in `fix` (what to do instead)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise RecipeError(f"{folder} is a file, not a folder: {fix}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise RecipeError(f"cannot write to {folder}: {e.strerror}: {fix}") from None


def write_files(folder: Path, files: dict[str, str], force: bool = False) -> list[Path]:
    """Write name -> text into folder (made if missing); existing files are refused unless force."""
    folder = Path(folder)
    targets = [folder / name for name in files]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not force:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise RecipeError(f"{existing[0]}{more} already exists: pass --force to overwrite, or write elsewhere")
    make_folder(folder, "write elsewhere")
    try:
        for target, text in zip(targets, files.values()):
            target.write_text(text, encoding="utf-8")
    except OSError as e:
        raise RecipeError(f"cannot write to {folder}: {e.strerror}: write elsewhere") from None
    return targets


def readable_files(folder: Path) -> None:
    """Give the files in `folder` the permissions the user's umask gives any new file: safetensors writes its
    files through a private temporary file (mode 0600), so saved weights would be unreadable by the group
    while the configs beside them are not."""
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(folder).iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)
