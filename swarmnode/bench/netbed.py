"""A network test bed of Linux network namespaces, for tests and benches that need real links: NAT,
bandwidth caps, partitions (iproute2, `tc`, `iptables`; root only).

    with NetBed() as bed:
        wan = bed.bridge("10.240.7.0/24")                     # a switch in the root namespace (host .1)
        a = bed.namespace("a"); bed.attach(a, wan, "10.240.7.2", rate_mbit=100)
        home = bed.nat_router("home", wan, "10.240.7.9", "10.241.7.0/24")
        laptop = bed.namespace("laptop"); bed.attach(laptop, home.lan, "10.241.7.2")
        subprocess.run([*laptop.prefix, "swarmnode", "run", ...])   # or laptop.run([...])
        home.dial_attempts()                                  # connections from outside it refused

- A *namespace* is an empty network stack (loopback up). `attach` joins it to a *bridge* by a veth pair,
  gives it an address and a default route through the bridge's own address.
- `cap` (or `attach(..., rate_mbit=)`) shapes both directions of a link with `tc tbf` (this machine's
  kernel has no `netem`: rates only, no delay or loss), each end's egress: upload and download.
- A *NAT router* is a namespace with a WAN leg on a bridge and a LAN bridge of its own: it forwards its
  LAN out, masquerading it behind its WAN address (`iptables -t nat ... MASQUERADE`), and drops every
  new connection or flow that comes in from the WAN (a home router without port forwards), counting each
  one (`dial_attempts`). `route_to(lan)` gives the root namespace a route to a router's LAN through its
  WAN leg, so that what a host process dials at a LAN address reaches the router and is counted there.

Cleanup always runs: the `with` block (or `close()`) deletes every namespace, link and bridge it made, in
reverse order, each step on its own (a failing one does not stop the rest). Names carry the creating
process id (`sn<pid>…`, interface names within Linux's 15 characters), and a new bed first deletes the
leftovers of beds whose process is gone (a SIGKILLed test), so a crashed run never blocks the next one.
`unavailable()` says why a bed cannot be built here (None: it can); `NetBed()` raises `NetBedUnavailable`.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

from swarmnode.util.errors import ConfigError

TOOLS = ("ip", "tc", "iptables")
_NAME = re.compile(r"^sn(\d+)[a-z]\d+[a-z]?$")  # interfaces: sn<pid><kind><index>[side]
_NETNS = re.compile(r"^sn(\d+)-")  # namespaces: sn<pid>-<name>


class NetBedUnavailable(RuntimeError):
    """This machine cannot build a bed (not root, a tool missing, or namespaces refused)."""


class NetBedError(RuntimeError):
    """A bed command failed; the message names it and carries its stderr."""


def unavailable() -> str | None:
    """Why a bed cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    return f"missing {', '.join(missing)}" if missing else None


def require_bed(bench: str, mbit: float) -> None:
    """A capped-bed bench's preconditions as one-line usage errors: a positive `--mbit`, and a machine
    where the bed can be built."""
    if not mbit > 0:
        raise ConfigError(f"--mbit: must be positive, got {mbit}")
    reason = unavailable()
    if reason is not None:
        raise ConfigError(f"{bench} builds network namespaces: {reason} (run it as root)")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetBedError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class Namespace:
    """A network namespace of the bed."""

    name: str

    @property
    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside this namespace."""
        return ["ip", "netns", "exec", self.name]

    def run(self, argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Runs `argv` inside this namespace and waits for it; NetBedError if it fails and `check`."""
        return _run([*self.prefix, *argv], check)


@dataclass(frozen=True)
class Bridge:
    """A switch: a Linux bridge in `namespace` (None: the root namespace), with `address` on it."""

    device: str
    network: ipaddress.IPv4Network
    address: str
    namespace: Namespace | None = None


@dataclass(frozen=True)
class Link:
    """A veth pair: `inner` in `namespace` (with `address`), `outer` enslaved to `bridge`."""

    namespace: Namespace
    bridge: Bridge
    inner: str
    outer: str
    address: str


@dataclass(frozen=True)
class Router:
    """A NAT router: its namespace, its WAN leg and the LAN bridge it masquerades."""

    namespace: Namespace
    wan: Link
    lan: Bridge

    def zero_counters(self) -> None:
        """Starts `dial_attempts` from 0 again."""
        for chain in ("INPUT", "FORWARD"):
            self.namespace.run(["iptables", "-Z", chain])

    def dial_attempts(self) -> int:
        """Packets that tried to open a new connection or flow from the WAN (to the router itself or
        through it to the LAN), all refused; replies to the LAN's own traffic are not counted."""
        total = 0
        for chain in ("INPUT", "FORWARD"):
            listing = self.namespace.run(["iptables", "-L", chain, "-n", "-v", "-x"]).stdout
            for line in listing.splitlines():
                if "DROP" in line and self.wan.inner in line:
                    total += int(line.split()[0])
        return total


@dataclass
class NetBed:
    """A set of namespaces, bridges and links, all removed again by `close()` (or the `with` block)."""

    _undo: list[list[str]] = field(default_factory=list, init=False)
    _count: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        reason = unavailable()
        if reason is not None:
            raise NetBedUnavailable(reason)
        sweep_leftovers()
        self._pid = os.getpid()

    def __enter__(self) -> NetBed:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Deletes everything this bed made, newest first; never raises."""
        undo, self._undo = self._undo, []
        for argv in reversed(undo):
            _run(argv, check=False)

    def _ifname(self, kind: str) -> str:
        self._count += 1
        name = f"sn{self._pid}{kind}{self._count}"
        assert len(name) <= 14, name  # a veth side appends one letter; Linux allows 15
        return name

    # ----- building -----

    def namespace(self, name: str) -> Namespace:
        """A new namespace with loopback up (its name: ``sn<pid>-<name>``)."""
        ns = Namespace(f"sn{self._pid}-{name}")
        _run(["ip", "netns", "add", ns.name])
        self._undo.append(["ip", "netns", "del", ns.name])
        ns.run(["ip", "link", "set", "lo", "up"])
        return ns

    def bridge(self, cidr: str, namespace: Namespace | None = None) -> Bridge:
        """A bridge on `cidr` in `namespace` (None: the root namespace, where this process runs), with the
        network's first address on it (the gateway of namespaces attached to it); the bed names it."""
        network = ipaddress.IPv4Network(cidr)
        device = self._ifname("b")
        gateway = str(next(network.hosts()))
        run = namespace.run if namespace is not None else _run
        run(["ip", "link", "add", device, "type", "bridge"])
        if namespace is None:
            self._undo.append(["ip", "link", "del", device])
        run(["ip", "addr", "add", f"{gateway}/{network.prefixlen}", "dev", device])
        run(["ip", "link", "set", device, "up"])
        return Bridge(device, network, gateway, namespace)

    def attach(
        self, namespace: Namespace, bridge: Bridge, address: str, rate_mbit: float | None = None
    ) -> Link:
        """Joins `namespace` to `bridge` by a veth pair with `address` on its side and a default route
        through the bridge's address; `rate_mbit` caps both directions."""
        base = self._ifname("v")
        inner, outer = f"{base}i", f"{base}o"
        _run(["ip", "link", "add", inner, "type", "veth", "peer", "name", outer])
        self._undo.append(["ip", "link", "del", outer])  # gone with the namespace too: harmless twice
        _run(["ip", "link", "set", inner, "netns", namespace.name])
        if bridge.namespace is not None:
            _run(["ip", "link", "set", outer, "netns", bridge.namespace.name])
        outside = bridge.namespace.run if bridge.namespace is not None else _run
        outside(["ip", "link", "set", outer, "master", bridge.device])
        outside(["ip", "link", "set", outer, "up"])
        namespace.run(["ip", "addr", "add", f"{address}/{bridge.network.prefixlen}", "dev", inner])
        namespace.run(["ip", "link", "set", inner, "up"])
        namespace.run(["ip", "route", "add", "default", "via", bridge.address])
        link = Link(namespace, bridge, inner, outer, address)
        if rate_mbit is not None:
            self.cap(link, rate_mbit)
        return link

    def cap(self, link: Link, up_mbit: float, down_mbit: float | None = None) -> None:
        """Caps `link` with `tc tbf`: `up_mbit` out of its namespace, `down_mbit` (default: the same) in."""
        outside = link.bridge.namespace.run if link.bridge.namespace is not None else _run
        link.namespace.run(_tbf(link.inner, up_mbit))
        outside(_tbf(link.outer, up_mbit if down_mbit is None else down_mbit))

    def nat_router(self, name: str, wan: Bridge, wan_address: str, lan_cidr: str) -> Router:
        """A router namespace on `wan` at `wan_address` whose LAN (`lan_cidr`, the router at its first
        address) goes out masqueraded, and which drops and counts every new inbound flow from the WAN."""
        ns = self.namespace(name)
        leg = self.attach(ns, wan, wan_address)
        lan = self.bridge(lan_cidr, namespace=ns)
        ns.run(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        ns.run(
            [
                "iptables",
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-s",
                lan_cidr,
                "-o",
                leg.inner,
                "-j",
                "MASQUERADE",
            ]
        )
        for chain in ("INPUT", "FORWARD"):
            ns.run(
                [
                    "iptables",
                    "-A",
                    chain,
                    "-i",
                    leg.inner,
                    "-m",
                    "conntrack",
                    "--ctstate",
                    "ESTABLISHED,RELATED",
                    "-j",
                    "ACCEPT",
                ]
            )
            ns.run(["iptables", "-A", chain, "-i", leg.inner, "-j", "DROP"])
        return Router(ns, leg, lan)

    def route_to(self, router: Router) -> None:
        """A route from the root namespace to `router`'s LAN through its WAN leg."""
        _run(["ip", "route", "add", str(router.lan.network), "via", router.wan.address])
        self._undo.append(["ip", "route", "del", str(router.lan.network)])


def _tbf(device: str, mbit: float) -> list[str]:
    """A token-bucket qdisc of `mbit` on `device`'s egress: a burst of 10 ms of traffic (at least 16 KB,
    so a full-size segment always fits) and at most 50 ms of queue."""
    if not mbit > 0:
        raise ValueError(f"a rate cap must be positive, got {mbit} Mbit/s")
    burst = max(16_000, int(mbit * 1e6 / 8 * 0.01))
    return [
        "tc",
        "qdisc",
        "replace",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{mbit}mbit",
        "burst",
        str(burst),
        "latency",
        "50ms",
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers() -> None:
    """Deletes the namespaces and root-namespace interfaces of beds whose process is gone."""
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NETNS.match(name)
        if match and not _alive(int(match.group(1))):
            _run(["ip", "netns", "del", name], check=False)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        device = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        match = _NAME.match(device)
        if match and not _alive(int(match.group(1))):
            _run(["ip", "link", "del", device], check=False)
