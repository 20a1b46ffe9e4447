"""Which mount holds a folder, read from a mounts table in /proc/self/mounts's format (here a g6e's, as the Deep
Learning AMI mounts it: the root volume, an EBS volume at /var/lib/coop, the instance store at /opt/dlami/nvme), and
which of the folders that must survive a stop live where a stop erases them."""

from __future__ import annotations

from pathlib import Path

from experiment.core import mounts

G6E = """\
/dev/root / ext4 rw,relatime,discard,errors=remount-ro 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /run tmpfs rw,nosuid,nodev,size=6507400k,mode=755 0 0
/dev/nvme2n1 /var/lib/coop ext4 rw,relatime 0 0
/dev/nvme1n1 /opt/dlami/nvme ext4 rw,relatime 0 0
/dev/nvme3n1 /mnt/with\\040space xfs rw,relatime 0 0
"""


def test_the_deepest_mount_above_a_folder_holds_it() -> None:
    table = mounts.parse(G6E)
    assert mounts.mount_of(Path("/opt/dlami/nvme/coop/runs"), table).source == "/dev/nvme1n1"
    assert mounts.mount_of(Path("/opt/dlami/nvme"), table).source == "/dev/nvme1n1"
    assert mounts.mount_of(Path("/opt/dlami/nvmeother"), table).point == Path("/")  # a prefix of a name is not a parent
    assert mounts.mount_of(Path("/var/lib/coop/work"), table).fstype == "ext4"
    assert mounts.mount_of(Path("/mnt/with space/seed"), table).fstype == "xfs"  # the table's octal escape


def test_a_later_mount_over_the_same_point_hides_the_earlier() -> None:
    table = mounts.parse(G6E + "tmpfs /var/lib/coop tmpfs rw 0 0\n")
    assert mounts.mount_of(Path("/var/lib/coop/work"), table).fstype == "tmpfs"


def test_durable_folders_on_the_instance_store_are_named_with_their_mount() -> None:
    folders = {
        "work folder": Path("/opt/dlami/nvme/coop"),
        "seed folder": Path("/var/lib/coop/seed/SmolLM2-1.7B-Instruct"),
        "reference home": Path("/opt/dlami/nvme/reference-home"),
    }
    found = mounts.ephemeral_folders(folders, mounts.KNOWN_EPHEMERAL, mounts.parse(G6E))
    assert found == [
        f"the {role} {folders[role]} is on /opt/dlami/nvme (ext4 from /dev/nvme1n1), which a stop of this host "
        'erases; put it on a durable volume (docs/operating.md, "Storage")'
        for role in ("work folder", "reference home")
    ]


def test_a_folder_is_ephemeral_only_on_a_named_mount_point() -> None:
    """An AMI without instance store: /opt/dlami/nvme is a plain folder of the root volume, which survives a stop; a
    mount the operator names (--ephemeral-mount) counts as the instance store does."""
    without = mounts.parse("/dev/root / ext4 rw 0 0\n")
    folders = {"work folder": Path("/opt/dlami/nvme/coop")}
    assert mounts.ephemeral_folders(folders, mounts.KNOWN_EPHEMERAL, without) == []
    durable = {"work folder": Path("/var/lib/coop/w")}
    named = mounts.ephemeral_folders(durable, [Path("/var/lib/coop")], mounts.parse(G6E))
    assert len(named) == 1 and "is on /var/lib/coop (ext4 from /dev/nvme2n1)" in named[0]
