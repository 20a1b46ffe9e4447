"""Hosts (two, or --hosts K up to 8) and a coordinator on one machine, each in its own network namespace (root only).

    coordinator ns  198.18.N.1 on the bridge "public"
      |-- veth --  host-a ns: pub0 198.18.N.2          priv0 198.19.N.1 --.
      |-- veth --  host-b ns: pub0 198.18.N.3          priv0 198.19.N.2 ---+-- switch ns: the bridge "private"
      |   ...                                                               |   (the hosts' one shared private link)
      '-- veth --  this machine: coop-N-op 198.18.N.254 (the operator's link: the CLI, a browser, a test)

The addresses come from 198.18.0.0/15, the range set aside for benchmarking networks (RFC 2544). Each set takes
the first N (1-250) whose two /24s this machine does not route yet, so that sets made side by side never clash
with each other or with the machine's own networks. No namespace has a default route: a process inside reaches
only the namespaces of its set and the operator's address. The private link may be shaped with ``tbf`` on every
host's end (``--rate``): what one host sends to the others leaves through its own shaped priv0. ``down`` kills
every process still inside the set's namespaces, then removes them and the operator's link.

    python3 scripts/namespaces.py up --prefix coop-1234 [--hosts 4] [--rate 1gbit]   # prints the topology as JSON
    python3 scripts/namespaces.py down --prefix coop-1234
    python3 scripts/namespaces.py cut --prefix coop-1234 --host host-a --link public|private [--seconds N]
    python3 scripts/namespaces.py mend --prefix coop-1234 --host host-a --link public|private
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SUBNETS = range(1, 251)
LOCK = Path("/run/coop-namespaces.lock")
HOST_NAMES = tuple(f"host-{letter}" for letter in "abcdefgh")
PUBLIC_INTERFACE = "pub0"
PRIVATE_INTERFACE = "priv0"
# tbf's bucket: at least one rate-second's worth of a timer tick (10 ms at 1 Gbit/s = 1.25 MB), so that the
# shaper, not the bucket, sets the pace; the queue holds 50 ms of traffic at the rate before it drops.
TBF_LATENCY = "50ms"


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    public_address: str
    private_address: str
    public_interface: str = PUBLIC_INTERFACE
    private_interface: str = PRIVATE_INTERFACE


@dataclass(frozen=True)
class Topology:
    prefix: str
    subnet: int
    coordinator_namespace: str
    switch_namespace: str  # the bridge of the hosts' shared private link
    coordinator_address: str
    operator_interface: str  # on this machine
    operator_address: str
    hosts: tuple[Host, ...]
    private_rate: str | None


def _networks(subnet: int) -> tuple[ipaddress.IPv4Network, ipaddress.IPv4Network]:
    return ipaddress.IPv4Network(f"198.18.{subnet}.0/24"), ipaddress.IPv4Network(f"198.19.{subnet}.0/24")


def _operator_interface(subnet: int) -> str:
    return f"coop-{subnet}-op"  # at most 15 characters, an interface name's limit


def _run(*args: str, namespace: str | None = None) -> str:
    command = ["ip", "netns", "exec", namespace, *args] if namespace else list(args)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _namespaces(prefix: str) -> list[str]:
    listed = json.loads(_run("ip", "-j", "netns", "list") or "[]")
    return sorted(entry["name"] for entry in listed if entry["name"].startswith(prefix + "-"))


def _routed() -> list[ipaddress.IPv4Network]:
    """Every network this machine routes (the default route aside)."""
    found = []
    for route in json.loads(_run("ip", "-j", "-4", "route", "show", "table", "all") or "[]"):
        destination = route.get("dst", "")
        if destination and destination[0].isdigit():
            found.append(ipaddress.IPv4Network(destination if "/" in destination else f"{destination}/32", False))
    return found


def _free_subnet() -> int:
    """The first N whose two networks overlap nothing this machine routes."""
    routed = _routed()
    for subnet in SUBNETS:
        if not any(n.overlaps(used) for n in _networks(subnet) for used in routed):
            return subnet
    raise RuntimeError("every subnet of 198.18.0.0/15 this script uses is routed already; nothing was made")


def shape(namespace: str, interface: str, rate: str) -> None:
    """``tbf`` at ``rate`` on the egress of ``interface``; both ends shaped shape both directions."""
    bits = _rate_bits(rate)
    burst = max(2 * 1514, bits // 8 // 100)  # 10 ms at the rate
    _run(
        "tc", "qdisc", "replace", "dev", interface, "root", "tbf",
        "rate", rate, "burst", str(burst), "latency", TBF_LATENCY,
        namespace=namespace,
    )  # fmt: skip


def _rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, factor in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"rate {rate!r} is not a number of bit, kbit, mbit or gbit")


def up(prefix: str, rate: str | None, count: int = 2) -> Topology:
    if os.geteuid() != 0:
        raise RuntimeError("network namespaces need root")
    # One set is made at a time on this machine: two made at once could both find the same subnet free.
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _up(prefix, rate, count)


def _up(prefix: str, rate: str | None, count: int) -> Topology:
    if _namespaces(prefix):
        raise RuntimeError(f"namespaces {prefix}-* exist already; run down first")
    subnet = _free_subnet()
    public, private = _networks(subnet)
    coordinator = f"{prefix}-coordinator"
    hosts = tuple(
        Host(name, f"{prefix}-{name}", str(public[2 + i]), str(private[1 + i]))
        for i, name in enumerate(HOST_NAMES[:count])
    )
    switch = f"{prefix}-switch"
    operator = _operator_interface(subnet)
    try:
        for namespace in (coordinator, switch, *(h.namespace for h in hosts)):
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "set", "lo", "up", namespace=namespace)
        _run("ip", "link", "add", "public", "type", "bridge", namespace=coordinator)
        _run("ip", "addr", "add", f"{public[1]}/{public.prefixlen}", "dev", "public", namespace=coordinator)
        _run("ip", "link", "set", "public", "up", namespace=coordinator)
        _run("ip", "link", "add", operator, "type", "veth", "peer", "name", "to-operator", "netns", coordinator)
        _run("ip", "link", "set", "to-operator", "master", "public", "up", namespace=coordinator)
        _run("ip", "addr", "add", f"{public[254]}/{public.prefixlen}", "dev", operator)
        _run("ip", "link", "set", operator, "up")
        _run("ip", "link", "add", "private", "type", "bridge", namespace=switch)
        _run("ip", "link", "set", "private", "up", namespace=switch)
        for host in hosts:
            _plug(host, coordinator, "public", PUBLIC_INTERFACE, f"{host.public_address}/{public.prefixlen}")
            _plug(host, switch, "private", PRIVATE_INTERFACE, f"{host.private_address}/{private.prefixlen}")
            if rate is not None:
                shape(host.namespace, PRIVATE_INTERFACE, rate)
    except Exception:
        down(prefix)
        _remove_operator_link(operator)
        raise
    return Topology(prefix, subnet, coordinator, switch, str(public[1]), operator, str(public[254]), hosts, rate)


def _plug(host: Host, namespace: str, bridge: str, interface: str, address: str) -> None:
    """A veth from ``bridge`` in ``namespace`` to the host, whose end is ``interface`` with ``address``, up."""
    port = f"to-{host.name}"
    _run(
        "ip", "link", "add", port, "netns", namespace, "type", "veth",
        "peer", "name", interface, "netns", host.namespace,
    )  # fmt: skip
    _run("ip", "link", "set", port, "master", bridge, "up", namespace=namespace)
    _run("ip", "addr", "add", address, "dev", interface, namespace=host.namespace)
    _run("ip", "link", "set", interface, "up", namespace=host.namespace)


def _remove_operator_link(interface: str) -> None:
    with contextlib.suppress(RuntimeError):  # gone already: it goes with the coordinator's namespace
        _run("ip", "link", "del", interface)


def down(prefix: str) -> list[str]:
    """Kill what runs inside the set's namespaces, then remove them; returns the names removed."""
    removed = []
    coordinator = f"{prefix}-coordinator"
    if coordinator in _namespaces(prefix):
        # The operator's link would go with the namespace, but only once the kernel frees it, which can lag.
        bridge = json.loads(_run("ip", "-j", "-4", "addr", "show", "dev", "public", namespace=coordinator) or "[]")
        for entry in bridge:
            for address in entry.get("addr_info", []):
                _remove_operator_link(_operator_interface(int(address["local"].split(".")[2])))
    for namespace in _namespaces(prefix):
        pids = _run("ip", "netns", "pids", namespace).split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _run("ip", "netns", "pids", namespace).split() and time.monotonic() < deadline:
            time.sleep(0.05)
        _run("ip", "netns", "del", namespace)
        removed.append(namespace)
    return removed


def cut(prefix: str, host: str, link: str, seconds: float | None) -> None:
    """Take one host's public or private link down (for ``seconds``, then up again; else until ``mend``)."""
    _set_link(prefix, host, link, "down")
    if seconds is not None:
        time.sleep(seconds)
        _set_link(prefix, host, link, "up")


def mend(prefix: str, host: str, link: str) -> None:
    _set_link(prefix, host, link, "up")


def _set_link(prefix: str, host: str, link: str, state: str) -> None:
    interface = PUBLIC_INTERFACE if link == "public" else PRIVATE_INTERFACE
    _run("ip", "link", "set", interface, state, namespace=f"{prefix}-{host}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("up")
    make.add_argument("--prefix", required=True)
    make.add_argument("--rate", help="shape the private link to this rate at every host, e.g. 1gbit, 200mbit")
    make.add_argument("--hosts", type=int, choices=range(2, len(HOST_NAMES) + 1), default=2, help="how many hosts")
    commands.add_parser("down").add_argument("--prefix", required=True)
    for name in ("cut", "mend"):
        link = commands.add_parser(name)
        link.add_argument("--prefix", required=True)
        link.add_argument("--host", choices=HOST_NAMES, required=True)
        link.add_argument("--link", choices=("public", "private"), required=True)
        if name == "cut":
            link.add_argument("--seconds", type=float, help="mend it after this long (else: until mend)")
    args = parser.parse_args()
    try:
        if args.command == "up":
            print(json.dumps(asdict(up(args.prefix, args.rate, args.hosts))))
        elif args.command == "down":
            print(json.dumps({"removed": down(args.prefix)}))
        elif args.command == "cut":
            cut(args.prefix, args.host, args.link, args.seconds)
        else:
            mend(args.prefix, args.host, args.link)
    except (RuntimeError, ValueError) as exc:
        print(f"namespaces: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
