"""The members of a home or evidence bundle that came from elsewhere, read without leaving it: the folder holds only
plain files and folders, and a file that names another file names one inside its own folder."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from experiment.core.errors import CoopError


def refuse_links(home: Path) -> None:
    """Refuse a folder holding a symbolic link (or a pipe, a device) anywhere under it: a link, wherever it points,
    lets a later change outside the bundle change what the bundle says."""
    for folder, folders, files in os.walk(home):  # a link to a folder is listed, never followed
        for name in sorted(folders + files):
            path = Path(folder, name)
            if path.is_symlink():
                why = f"is a symbolic link (to {os.readlink(path)})"
            elif not (path.is_file() or path.is_dir()):
                why = "is not a plain file or folder"
            else:
                continue
            raise CoopError(f"{home}: {path.relative_to(home).as_posix()}: {why}; a bundle holds only plain files")


def member(home: Path, folder: str, name: str, named_by: str) -> Path:
    """``home / folder / name`` for a ``name`` read from one of the home's own files (``named_by``: which, and where in
    it), refused when it is absolute, climbs with ``..`` or resolves outside ``folder``."""
    why = _outside(home, folder, name)
    if why is not None:
        shown = name if PurePosixPath(name).is_absolute() else f"{folder}/{name}"
        raise CoopError(f"{home}: {shown}: {why} (named by {named_by}); a bundle names only its own files")
    return home / folder / name


def _outside(home: Path, folder: str, name: str) -> str | None:
    path = PurePosixPath(name)
    if path.is_absolute():
        return "is an absolute path"
    if ".." in path.parts:
        return "climbs out of its folder with '..'"
    if not (home / folder / name).resolve().is_relative_to((home / folder).resolve()):
        return f"resolves outside {folder}/"
    return None
