"""Which mount a folder lives on, and whether that mount outlives a stop of the host.

A g6e's NVMe instance store (the Deep Learning AMI mounts it at /opt/dlami/nvme) is erased whenever the instance
stops, and the deadline timer stops it. What a run must find again after a stop (checkpoints and their pointers, the
spool, the seed, the reference home, the coordinator's database and blobs) therefore lives on a durable volume, and a
folder of that kind on an ephemeral mount is refused at start, naming the folder and the mount."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

MOUNTS_TABLE = Path("/proc/self/mounts")
# The Deep Learning AMI's mount of the instance store; an operator names others (--ephemeral-mount).
KNOWN_EPHEMERAL = (Path("/opt/dlami/nvme"),)


@dataclass(frozen=True)
class Mount:
    point: Path
    fstype: str
    source: str


def _unescape(field: str) -> str:
    """A field of the mounts table, whose spaces, tabs, newlines and backslashes are written as octal escapes."""
    for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escaped, char)
    return field


def parse(table: str) -> list[Mount]:
    """The mounts of a table in /proc/self/mounts's format, in its order (a later mount over a point hides the
    earlier one)."""
    mounts = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            mounts.append(Mount(Path(_unescape(fields[1])), fields[2], _unescape(fields[0])))
    return mounts


def read(table: Path = MOUNTS_TABLE) -> list[Mount]:
    return parse(table.read_text())


def mount_of(folder: Path, mounts: Iterable[Mount]) -> Mount:
    """The mount that holds ``folder`` (made absolute, links resolved): the last of the deepest mount points that
    hold it."""
    path = folder.resolve()
    found: Mount | None = None
    for mount in mounts:
        holds = path == mount.point or mount.point in path.parents
        if holds and (found is None or len(mount.point.parts) >= len(found.point.parts)):
            found = mount
    if found is None:
        raise ValueError(f"no mount holds {path}")  # the table lacks / itself: not a mounts table
    return found


def ephemeral_folders(folders: Mapping[str, Path], ephemeral: Iterable[Path], mounts: Iterable[Mount]) -> list[str]:
    """One line for each folder that must survive a stop but lives on a mount that does not: its role, its path,
    and the mount. A folder on a plain directory of the root volume whose path only looks like an ephemeral mount's
    (an AMI without instance store) is durable: only a mount point counts."""
    known = {point.resolve() for point in ephemeral}
    table = list(mounts)
    lines = []
    for role, folder in folders.items():
        mount = mount_of(folder, table)
        if mount.point.resolve() in known:
            lines.append(
                f"the {role} {folder} is on {mount.point} ({mount.fstype} from {mount.source}), which a stop of this "
                f'host erases; put it on a durable volume (docs/operating.md, "Storage")'
            )
    return lines
