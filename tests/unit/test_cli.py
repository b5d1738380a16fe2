"""The `swarmnode` command: start-up checks before anything listens, and the data-dir lock."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from swarmnode import cli, node
from swarmnode.config import ConfigError

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
        (["--advertise-host", "no-such-host.invalid"], "--advertise-host"),
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


def test_a_second_lock_on_a_data_dir_names_the_holder(tmp_path: Path) -> None:
    held = node.lock_data_dir(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"--data-dir: .*pid {os.getpid()}\b"):
            node.lock_data_dir(tmp_path)  # another open file description: flock refuses it too
    finally:
        os.close(held)
    os.close(node.lock_data_dir(tmp_path))  # released with its holder
    assert (tmp_path / node.LOCK_FILE).read_text() == f"{os.getpid()}\n"
