"""The hosts on one machine (scripts/namespaces.py): who reaches whom, the shaped shared private link, a cut link,
and that nothing is left behind. They need root, as CI and `make test` have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.hosts import hosts, namespaces

SCRIPT = [sys.executable, str(ROOT / "scripts" / "namespaces.py")]  # run directly where a refusal is the point

# Connect from inside a namespace; prints "open" when something answered or refused (the address was reached),
# "unreachable" when the connection timed out or had no route.
_REACH = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=1.5).close()
    print("open")
except ConnectionRefusedError:
    print("open")
except OSError:
    print("unreachable")
"""


@pytest.fixture
def topology() -> Iterator[dict[str, Any]]:
    with hosts("test", rate="200mbit") as made:
        yield made


def _reaches(namespace: str, address: str) -> bool:
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", _REACH, address],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip() == "open"


def _qdisc(host: dict[str, Any]) -> str:
    """What shapes the host's end of the private link (tc's words)."""
    command = ["ip", "netns", "exec", host["namespace"], "tc", "qdisc", "show", "dev", host["private_interface"]]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def test_each_host_reaches_the_coordinator_and_its_peer_privately_and_nothing_else(topology: dict[str, Any]) -> None:
    a, b = topology["hosts"]
    assert a["public_address"] != b["public_address"] and "127." not in a["public_address"] + b["public_address"]
    assert _reaches(a["namespace"], topology["coordinator_address"])
    assert _reaches(a["namespace"], b["public_address"])
    assert _reaches(a["namespace"], b["private_address"])
    assert _reaches(b["namespace"], a["private_address"])
    assert _reaches(a["namespace"], topology["operator_address"])
    # The coordinator is not on the private link, and no namespace routes out of its set.
    assert not _reaches(topology["coordinator_namespace"], a["private_address"])
    assert not _reaches(a["namespace"], "192.0.2.1")  # TEST-NET-1: would need a default route
    shaped = _qdisc(a)
    assert "tbf" in shaped and "rate 200Mbit" in shaped


def test_four_hosts_share_one_private_link_each_end_shaped() -> None:
    with hosts("four", rate="200mbit", count=4) as made:
        members = made["hosts"]
        assert [h["name"] for h in members] == ["host-a", "host-b", "host-c", "host-d"]
        for host in members:
            assert all(_reaches(host["namespace"], peer["private_address"]) for peer in members if peer is not host)
            assert "rate 200Mbit" in _qdisc(host), host["name"]


def test_a_cut_link_blocks_until_it_is_mended(topology: dict[str, Any]) -> None:
    a, b = topology["hosts"]
    prefix = topology["prefix"]
    namespaces("cut", "--prefix", prefix, "--host", "host-b", "--link", "private")
    assert not _reaches(a["namespace"], b["private_address"])
    assert _reaches(a["namespace"], b["public_address"])  # the public link is another link
    namespaces("mend", "--prefix", prefix, "--host", "host-b", "--link", "private")
    assert _reaches(a["namespace"], b["private_address"])


def test_down_removes_the_namespaces_their_processes_and_the_operators_link() -> None:
    prefix = f"coop-test-down-{os.getpid()}"
    made = json.loads(namespaces("up", "--prefix", prefix))
    sleeper = subprocess.Popen(["ip", "netns", "exec", made["hosts"][0]["namespace"], "sleep", "600"])
    refused = subprocess.run([*SCRIPT, "up", "--prefix", prefix], capture_output=True, text=True)
    assert refused.returncode == 2 and "exist already" in refused.stderr
    removed = json.loads(namespaces("down", "--prefix", prefix))["removed"]
    switch, hosts_ = made["switch_namespace"], [h["namespace"] for h in made["hosts"]]
    assert sorted(removed) == sorted([made["coordinator_namespace"], switch, *hosts_])
    assert sleeper.wait(timeout=10) == -9  # killed, not left running in a namespace nobody can name
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert prefix not in listed
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert made["operator_interface"] not in links
