"""`swarmnode run` refuses what it cannot do before anything listens, and one data dir serves one node:
real processes on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmnode.bench.procs import child_env
from swarmnode.net.identity import Identity
from swarmtest import TINY_ARGS, ProcessReaper

pytestmark = pytest.mark.timeout(120)
RUN = (sys.executable, "-m", "swarmnode.cli", "run", *TINY_ARGS)
READ_ONLY_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A node's data dir with its identity key, and a command prefix under which the directory is
    read-only: a private read-only bind mount for root (who may write in any directory), its mode 0555
    for anyone else."""
    directory = tmp_path / "ro"
    Identity.load_or_create(directory / "identity.key")
    if os.geteuid() != 0:
        directory.chmod(0o555)
        yield directory, []
        directory.chmod(0o755)
        return
    prefix = ["unshare", "-m", "sh", "-c", READ_ONLY_MOUNT, str(directory)]
    if (
        shutil.which("unshare") is None
        or subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode
    ):
        pytest.skip("no private mount namespace here")
    assert subprocess.run(
        [*prefix, "touch", str(directory / "probe")], capture_output=True, timeout=30
    ).returncode
    yield directory, prefix


def test_a_read_only_data_dir_exits_2_before_anything_listens(read_only: tuple[Path, list[str]]) -> None:
    """With its key already there the node used to start, listen, and then fail on node.json.tmp."""
    data_dir, prefix = read_only
    out = subprocess.run(
        [*prefix, *RUN, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=90,
        env=child_env(),
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "--data-dir" in lines[0] and repr(str(data_dir)) in lines[0]
    assert not (data_dir / "node.json").exists()


def test_a_second_node_on_a_data_dir_exits_2_naming_the_first(tmp_path: Path, reaper: ProcessReaper) -> None:
    first = reaper.node(tmp_path / "node", []).start()
    info = first.wait_ready()
    out = subprocess.run(
        [*RUN, "--data-dir", str(first.data_dir)], capture_output=True, text=True, timeout=60, env=child_env()
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "--data-dir" in lines[0] and f"pid {info['pid']}" in lines[0], lines[0]
    assert first.wait_nowait() is None  # the first runs on, and its node.json is its own (its shard
    after = first.info  # moves when it claims one, which it may do meanwhile)
    assert {k: v for k, v in after.items() if k != "shard"} == {k: v for k, v in info.items() if k != "shard"}
