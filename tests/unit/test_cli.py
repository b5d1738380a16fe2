"""The `swarmnode` command: start-up checks before anything listens, the data-dir lock, a closed output
pipe, `swarmnode ledger check`, and what the demo hands its nodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmnode.bench import procs
from swarmnode.cli import demo
from swarmnode.cli import main as cli
from swarmnode.core.ledger import Ledger
from swarmnode.net import rpc, snapshot_server
from swarmnode.node import startup as node
from swarmnode.util.errors import ConfigError

TINY = (
    "--model",
    "tiny",
    "--host",
    "127.0.0.1",
    "--grpc-port",
    "0",
    "--dht-port",
    "0",
    "--metrics-port",
    "0",
)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    """`swarmnode ARGV` in this process: exit code, stdout and the lines of stderr."""
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


@pytest.fixture(autouse=True)
def no_logging_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real start set up in this process must not take over the test's log handlers."""
    monkeypatch.setattr(cli, "setup_logging", lambda log_format: None)
    monkeypatch.delenv("SWARMNODE_FAULTS", raising=False)


# ----- start-up checks -----


def test_an_unresolvable_host_exits_2_before_anything_is_created_or_listens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "node"
    argv = [*TINY, "--host", "999.1.1.1", "--data-dir", str(data_dir)]
    code, _, err = run_cli(capsys, "run", *argv)
    assert code == 2 and len(err) == 1, err
    assert "--host" in err[0] and "'999.1.1.1'" in err[0]
    assert not data_dir.exists()  # no identity key, no lock: the checks ran first


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--seq-len", "100000", "--model", "tiny"], "--seq-len"),
        (["--data", "/nonexistent/corpus"], "--data"),
        (["--host", "999.1.1.1"], "--host"),
        (["--host", "192.0.2.1"], "--host"),  # resolves, but is no address of this machine
        (["--advertise-host", "bad host"], "--advertise-host"),  # peers resolve it; its form is checked
        (["--num-shards", "100000", "--model", "tiny"], "--num-shards"),
        (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"], "--tls-cert"),
    ],
)
def test_dry_run_makes_the_checks_a_real_start_makes(
    argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "run", "--dry-run", "--data-dir", str(tmp_path / "d"), *argv)
    assert code == 2 and out == "" and len(err) == 1, err
    assert flag in err[0] and argv[argv.index(flag) + 1] in err[0], err[0]


def test_dry_run_refuses_a_data_dir_it_could_not_create(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = run_cli(capsys, "run", "--dry-run", "--data-dir", str(blocker / "node"))
    assert code == 2 and len(err) == 1 and "--data-dir" in err[0] and "not a directory" in err[0], err
    code, _, err = run_cli(
        capsys, "run", "--dry-run", "--data-dir", str(tmp_path), "--identity", str(tmp_path)
    )
    assert code == 2 and len(err) == 1 and "--identity" in err[0], err  # a directory is no key file


def test_dry_run_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    existing, new = tmp_path / "existing", tmp_path / "new" / "deeper"
    existing.mkdir()
    for data_dir in (existing, new):
        code, out, err = run_cli(capsys, "run", "--dry-run", *TINY, "--data-dir", str(data_dir))
        assert code == 0 and err == [] and json.loads(out)["data_dir"] == str(data_dir)
    assert list(existing.iterdir()) == [] and not new.parent.exists()


def test_dry_run_refuses_a_data_dir_a_running_node_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held = node.lock_data_dir(tmp_path)
    try:
        code, out, err = run_cli(capsys, "run", "--dry-run", *TINY, "--data-dir", str(tmp_path))
    finally:
        os.close(held)
    assert code == 2 and out == "" and len(err) == 1, err
    assert "--data-dir: in use by another swarmnode process" in err[0] and f"pid {os.getpid()}" in err[0]
    code, _, err = run_cli(capsys, "run", "--dry-run", *TINY, "--data-dir", str(tmp_path))
    assert code == 0, err  # released with its holder


@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_dry_run_finds_a_port_in_use(kind: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flag = "--grpc-port" if kind == socket.SOCK_STREAM else "--dht-port"
    with socket.socket(socket.AF_INET, kind) as taken:
        taken.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            taken.listen()
        port = taken.getsockname()[1]
        data_dir = tmp_path / "fresh"
        code, out, err = run_cli(
            capsys, "run", "--dry-run", *TINY, "--data-dir", str(data_dir), flag, str(port)
        )
    assert (
        code == 2
        and out == ""
        and err == [f"swarmnode run: error: {flag}: port {port} on 127.0.0.1 is already in use"]
    )
    assert not data_dir.exists()


def test_a_start_that_fails_after_the_checks_leaves_the_data_dir_as_it_was(tmp_path: Path) -> None:
    from swarmnode.node.config import NodeConfig

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "identity.key").write_bytes(b"someone's key")
    for data_dir in (tmp_path / "fresh", kept):
        fresh = node.FreshDataDir.note(NodeConfig(data_dir=data_dir))
        os.close(node.lock_data_dir(data_dir))
        (data_dir / "identity.key").touch()
        (data_dir / "snapshots").mkdir()
        fresh.undo()
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in kept.iterdir()) == ["identity.key"]  # what was there before stays
    assert (kept / "identity.key").read_bytes() == b"someone's key"


def test_a_second_lock_on_a_data_dir_names_the_holder(tmp_path: Path) -> None:
    held = node.lock_data_dir(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"--data-dir: .*pid {os.getpid()}\b"):
            node.lock_data_dir(tmp_path)  # another open file description: flock refuses it too
    finally:
        os.close(held)
    os.close(node.lock_data_dir(tmp_path))  # released with its holder
    assert (tmp_path / node.LOCK_FILE).read_text() == f"{os.getpid()}\n"


# ----- a closed output pipe -----


class NoSnapshots:
    def list_snapshots(self) -> list:
        return []

    def find(self, snapshot_id: str | None) -> None:
        return None


@contextlib.contextmanager
def status_server() -> Iterator[str]:
    """A gRPC status server on its own thread and event loop; yields its HOST:PORT."""
    ports: queue.Queue[int] = queue.Queue()
    stop = threading.Event()

    async def serve() -> None:
        server = await snapshot_server.start_server(
            "127.0.0.1", 0, NoSnapshots(), lambda: rpc.NodeStatus("n1", "run")
        )
        ports.put(server.port)
        await asyncio.to_thread(stop.wait)
        await server.stop(0)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="status-server")
    thread.start()
    try:
        yield f"127.0.0.1:{ports.get(timeout=30)}"
    finally:
        stop.set()
        thread.join(30)


def test_status_into_a_closed_pipe_exits_quietly() -> None:
    """`swarmnode status … | head`: the reader is gone before the command writes."""
    with status_server() as address:
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            out = subprocess.run(
                [sys.executable, "-m", "swarmnode.cli", "status", address, "--json"],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
            )
        finally:
            os.close(write_end)
    assert (out.returncode, out.stderr) == (1, "")


# ----- swarmnode ledger check -----


CURSOR = {"shard": 3, "epoch": 0, "position": 0}


def at(position: int, shard: int = 3) -> dict[str, int]:
    return {**CURSOR, "shard": shard, "position": position}


def write_ledger(data_dir: Path, node_id: str, second_round_start: int) -> None:
    ledger = Ledger(data_dir, node_id)
    ledger.adopt(CURSOR, "fresh", 0)
    ledger.round(0, at(0), at(40))
    ledger.settle(0, "applied", 2, "d1")
    ledger.round(1, at(second_round_start), at(second_round_start + 40))
    ledger.settle(1, "applied", 2, "d2")


def test_ledger_check_prints_one_line_per_node_and_fails_on_a_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    write_ledger(good, "aa" * 20, 40)
    write_ledger(bad, "bb" * 20, 48)  # its second round skips 8 windows
    code, out, err = run_cli(capsys, "ledger", "check", str(good))
    assert (code, err) == (0, []) and out.splitlines() == [
        f"{good}: node {'aa' * 6}: ok (2 rounds in the chain, 0 trained again)",
        f"shard 3: e0:0→e0:80 by {'aa' * 6} (rounds 0–1)",  # the swarm-wide view
    ]
    code, out, err = run_cli(capsys, "ledger", "check", str(good), str(bad))
    lines = out.splitlines()
    assert code == 1 and err == [] and len(lines) == 2, out
    assert lines[0].endswith("ok (2 rounds in the chain, 0 trained again)")
    assert (
        lines[1].startswith(f"{bad}: node {'bb' * 6}: 1 violation(s): round 1: starts at")
        and "skipped" in lines[1]
    )
    code, out, _ = run_cli(capsys, "ledger", "check", str(good), str(bad), "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert [(n["node_id"], len(n["violations"])) for n in report["nodes"]] == [("aa" * 20, 0), ("bb" * 20, 1)]


def test_ledger_check_holds_the_nodes_against_each_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The survivor's average of round 1 left the victim out, yet the victim's chain keeps round 1:
    each chain replays alone, the cross-check sees it."""
    survivor, victim = "aa" * 20, "bb" * 20
    for node_id, ledger in (
        (survivor, Ledger(tmp_path / "s", survivor)),
        (victim, Ledger(tmp_path / "v", victim)),
    ):
        shard = 2 if node_id == survivor else 3  # (each its own shard: they train no batch twice)
        ledger.adopt(at(0, shard), "fresh", 0)
        ledger.round(0, at(0, shard), at(40, shard))
        ledger.settle(0, "applied", 2, "d1", group=(survivor, victim), included=(survivor, victim))
        ledger.round(1, at(40, shard), at(80, shard))
        if node_id == survivor:
            ledger.settle(1, "applied", 2, "d2", group=(survivor, victim), included=(survivor,))
        else:
            ledger.adopt(at(80, shard), "peer", 2)  # it came back past round 1, as if its batches were in
    code, out, _ = run_cli(capsys, "ledger", "check", str(tmp_path / "s"), str(tmp_path / "v"))
    lines = out.splitlines()
    assert code == 1 and len(lines) == 5 and all(" ok (" in line for line in lines[:2]), out
    assert lines[2].startswith("shard 2: ") and lines[3].startswith("shard 3: ")
    assert lines[4].startswith("across nodes: ") and "round 1" in lines[4] and victim[:12] in lines[4]
    code, out, _ = run_cli(capsys, "ledger", "check", str(tmp_path / "s"), str(tmp_path / "v"), "--json")
    assert code == 1 and len(json.loads(out)["across_nodes"]) == 1


def test_ledger_check_refuses_a_directory_without_a_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_ledger(tmp_path / "good", "aa" * 20, 40)
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(capsys, "ledger", "check", str(tmp_path / "good"), str(tmp_path / "empty"))
    assert (code, out) == (2, "") and len(err) == 1 and str(tmp_path / "empty") in err[0], err


def test_ledger_check_reports_a_line_that_is_no_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_ledger(tmp_path, "aa" * 20, 40)
    with (tmp_path / "ledger.jsonl").open("a") as f:
        f.write('{"node_id": "' + "aa" * 20 + '", "event": "rou')  # a write cut short
    code, out, _ = run_cli(capsys, "ledger", "check", str(tmp_path))
    assert code == 1 and "line 6 is not a ledger entry" in out, out


# ----- swarmnode demo -----


def test_demo_nodes_get_no_swarmnode_setting_of_the_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWARMNODE_PEERS", "swarm.example.org:8468")
    monkeypatch.setenv("SWARMNODE_SWARM_TOKEN", "theirs")
    started: list[dict[str, str]] = []

    class Recorder:
        def __init__(self, argv: list[str], **kwargs: object) -> None:
            started.append(kwargs["env"])  # type: ignore[arg-type]

    monkeypatch.setattr(procs.subprocess, "Popen", Recorder)
    demo.DemoNode("node1", tmp_path, []).start()
    (env,) = started
    assert not [name for name in env if name.startswith("SWARMNODE_")]
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path.parent / "torch-cache") and "PATH" in env


def test_the_tls_hint_is_only_for_a_client_without_a_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused handshake and a node that crashed mid-call both read "Connection reset": only a client
    with no certificate to show is told about the TLS flags."""
    from swarmnode.cli.commands import refusal_line
    from swarmnode.net.security import Security

    reset = rpc.PeerUnavailable("unreachable", "127.0.0.1:5: Connection reset by peer")
    monkeypatch.setattr(rpc, "_client_security", Security(tls_ca=b"ca"))
    assert "refused the TLS handshake" in refusal_line("status", "127.0.0.1:5", reset)
    monkeypatch.setattr(rpc, "_client_security", Security(tls_cert=b"cert", tls_key=b"key", tls_ca=b"ca"))
    assert refusal_line("status", "127.0.0.1:5", reset) == f"swarmnode status: {reset}"
    assert "TLS" not in refusal_line("status", "127.0.0.1:5", reset)
