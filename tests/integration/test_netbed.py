"""The namespace test bed (`swarmnode.bench.netbed`): links, NAT without an inbound path, rate caps, and
cleanup that leaves nothing behind. Root only; skips cleanly otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from swarmnode.bench import netbed
from swarmnode.bench.netbed import Namespace, NetBed

SUBNET = 200 + os.getpid() % 50
"""The second octet of this run's subnets (another run in parallel most likely picks another)."""


Serve = Callable[[Namespace | None, str, int], None]


@pytest.fixture
def bed() -> Iterator[NetBed]:
    reason = netbed.unavailable()
    if reason is not None:
        pytest.skip(f"no network test bed here: {reason}")
    with NetBed() as made:
        yield made


@pytest.fixture
def serve(bed: NetBed) -> Iterator[Serve]:
    """Starts TCP servers in the bed's namespaces that answer each connection with "hello"; every one
    is killed and reaped at teardown, whatever failed, before the bed is taken down."""
    servers: list[subprocess.Popen[str]] = []

    def start(ns: Namespace | None, address: str, port: int) -> None:
        code = (
            "import socket,sys\n"
            f"s=socket.create_server(({address!r},{port}))\n"
            "print('up',flush=True)\n"
            "while True:\n"
            "    c,_=s.accept(); c.sendall(b'hello'); c.close()\n"
        )
        prefix = ns.prefix if ns is not None else []
        proc = subprocess.Popen([*prefix, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        servers.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"

    try:
        yield start
    finally:
        for proc in servers:
            proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


def _dial(ns: Namespace | None, address: str, port: int, timeout_s: float = 2.0) -> str:
    """What a TCP client in `ns` reads from `address:port` ("" when it cannot connect)."""
    code = (
        "import socket\n"
        "try:\n"
        f"    c=socket.create_connection(({address!r},{port}),timeout={timeout_s})\n"
        "    print(c.recv(16).decode())\n"
        "except OSError:\n"
        "    print('')\n"
    )
    prefix = ns.prefix if ns is not None else []
    return subprocess.run(
        [*prefix, sys.executable, "-c", code], capture_output=True, text=True
    ).stdout.strip()


def test_namespaces_on_a_bridge_reach_each_other_and_the_host(bed: NetBed, serve: Serve) -> None:
    wan = bed.bridge(f"10.{SUBNET}.1.0/24")
    a, b = bed.namespace("a"), bed.namespace("b")
    bed.attach(a, wan, f"10.{SUBNET}.1.2")
    bed.attach(b, wan, f"10.{SUBNET}.1.3")
    serve(b, f"10.{SUBNET}.1.3", 7001)
    assert _dial(a, f"10.{SUBNET}.1.3", 7001) == "hello"
    assert _dial(None, f"10.{SUBNET}.1.3", 7001) == "hello"  # the host is on the bridge (.1)


def test_a_node_behind_nat_dials_out_but_nothing_dials_in(bed: NetBed, serve: Serve) -> None:
    wan = bed.bridge(f"10.{SUBNET}.2.0/24")
    public = bed.namespace("public")
    bed.attach(public, wan, f"10.{SUBNET}.2.2")
    router = bed.nat_router("home", wan, f"10.{SUBNET}.2.9", f"10.{SUBNET}.3.0/24")
    laptop = bed.namespace("laptop")
    bed.attach(laptop, router.lan, f"10.{SUBNET}.3.2")
    bed.route_to(router)  # so that a host dial of the LAN address reaches the router and is counted
    serve(public, f"10.{SUBNET}.2.2", 7002)
    serve(laptop, "0.0.0.0", 7003)
    assert _dial(laptop, f"10.{SUBNET}.2.2", 7002) == "hello"
    assert router.dial_attempts() == 0  # replies to the laptop's own connection are not dials
    assert _dial(public, f"10.{SUBNET}.2.9", 7003, timeout_s=0.5) == ""  # the router's address
    assert _dial(None, f"10.{SUBNET}.3.2", 7003, timeout_s=0.5) == ""  # the LAN address itself
    assert router.dial_attempts() >= 2


def test_a_rate_cap_shapes_both_directions(bed: NetBed) -> None:
    wan = bed.bridge(f"10.{SUBNET}.4.0/24")
    a = bed.namespace("a")
    link = bed.attach(a, wan, f"10.{SUBNET}.4.2", rate_mbit=20)
    up = a.run(["tc", "qdisc", "show", "dev", link.inner]).stdout
    down = subprocess.run(["tc", "qdisc", "show", "dev", link.outer], capture_output=True, text=True).stdout
    assert "tbf" in up and "rate 20Mbit" in up
    assert "tbf" in down and "rate 20Mbit" in down
    bed.cap(link, 5, 50)
    assert "rate 5Mbit" in a.run(["tc", "qdisc", "show", "dev", link.inner]).stdout
    down = subprocess.run(["tc", "qdisc", "show", "dev", link.outer], capture_output=True, text=True).stdout
    assert "rate 50Mbit" in down


def test_close_removes_everything_and_leftovers_of_dead_beds_are_swept() -> None:
    reason = netbed.unavailable()
    if reason is not None:
        pytest.skip(f"no network test bed here: {reason}")
    with NetBed() as made:
        wan = made.bridge(f"10.{SUBNET}.5.0/24")
        ns = made.namespace("x")
        made.attach(ns, wan, f"10.{SUBNET}.5.2")
        router = made.nat_router("r", wan, f"10.{SUBNET}.5.9", f"10.{SUBNET}.6.0/24")
        made.route_to(router)
        prefix = f"sn{made._pid}"
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    # A bed of a process that died without closing: swept by the next bed.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = f"sn{dead.stdout.strip()}-stale"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with NetBed():
            assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)  # if the sweep missed it
