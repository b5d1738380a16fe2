"""The training state has one owner: a swarm run with the ownership check on (every change to the model,
the optimisers, θ_g, the cursor or the staging buffers asserts it runs on the training thread, every
ledger entry that it is appended by the ledger's one writer thread) trains, averages, snapshots and
recovers from a peer without one violation — blocking, with the outer step overlapped, and with
fragments; and the status path imports no torch."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from swarmnode.core.ledger import read_ledger
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import start_swarm, stop_all, wait_for

ARGS = (
    "--inner-steps",
    "10",
    "--hot-every",
    "3",
    "--cold-every",
    "1",
    "--wait-peers",
    "1",
    "--run-id",
    "own",
)


def settled(data_dir: Path) -> int:
    return sum(1 for e in read_ledger(data_dir) if e["event"] == "settle")


@pytest.mark.parametrize(
    "mode",
    [(), ("--overlap", "on"), ("--overlap", "on", "--fragments", "2")],
    ids=["blocking", "overlap", "fragments"],
)
def test_a_swarm_with_the_ownership_check_on_never_trips_it(
    tmp_path: Path, reaper, mode: tuple[str, ...]
) -> None:
    nodes = start_swarm(reaper, tmp_path, 2, [*ARGS, *mode], env={"SWARMNODE_CHECK_THREADS": "1"})
    wait_for(lambda: min(settled(n.data_dir) for n in nodes) >= 2, 90, "two rounds")
    victim = nodes[1]
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    shutil.rmtree(victim.data_dir / "snapshots")
    victim.restart()
    receipt = wait_for(lambda: read_receipts(victim.data_dir)[1:], 90, "the recovery from a peer")[0]
    assert receipt["source"] == "peer"
    done = settled(victim.data_dir)
    wait_for(lambda: settled(victim.data_dir) >= done + 2, 90, "two rounds after the recovery")
    stop_all(nodes)
    for node in nodes:
        log = node.log()
        assert "OwnershipError" not in log and "not the training thread" not in log, log[-3000:]
        assert "averaged with 2 members" in log and "failed; its work stays local" not in log, log[-3000:]


def test_the_status_and_fetch_commands_import_no_torch() -> None:
    probe = (
        "import sys\n"
        "from swarmnode.cli import main\n"
        "codes = [main.main(['status', '127.0.0.1:9'])]\n"
        "codes.append(main.main(['fetch', '127.0.0.1:9', '--out', '/dev/null']))\n"
        "print(codes, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[1, 1] False", (out.stdout, out.stderr)
