"""SwarmDHT across OS processes: three nodes on 127.0.0.1, real UDP between them."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]

# A node driven line by line: one JSON command per stdin line, one JSON answer per stdout line; EOF stops it.
RUNNER = r"""
import asyncio, json, sys
from swarmnode.net.dht import DHTConfig, SwarmDHT
from swarmnode.net.identity import Identity

async def main() -> None:
    identity = Identity.generate()
    dht = SwarmDHT(identity, DHTConfig(request_timeout_s=1.0))
    await dht.start(sys.argv[1:])
    print(json.dumps({"port": dht.port, "node_id": identity.node_id_hex}), flush=True)
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            command = json.loads(line)
            if command["op"] == "publish":
                answer = {"ok": await dht.publish(command["key"], command["value"], command["ttl_s"])}
            else:
                entries = await dht.get(command["key"])
                answer = {"entries": {sub: e.value for sub, e in entries.items()}, "peers": dht.peer_count()}
            print(json.dumps(answer), flush=True)
    finally:
        await dht.stop()

asyncio.run(main())
"""


class Child:
    """One runner process; its stdout lines are read by a thread so every wait has a deadline."""

    def __init__(self, bootstrap: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", RUNNER, *bootstrap],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = 0
        self.node_id = ""

    def wait_ready(self) -> None:
        hello = self.receive(timeout_s=15)
        self.port, self.node_id = hello["port"], hello["node_id"]

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def receive(self, timeout_s: float = 10) -> dict[str, Any]:
        try:
            answer: dict[str, Any] = json.loads(self._lines.get(timeout=timeout_s))
        except queue.Empty:
            raise AssertionError(f"node process {self.process.pid} did not answer in {timeout_s} s") from None
        return answer

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.receive()

    def close(self) -> None:
        """Ask it to stop (EOF on stdin); kill it if it does not exit promptly."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait(timeout=5)


@pytest.fixture
def spawn() -> Iterator[Callable[[list[str]], Child]]:
    """Starts runner processes; every one is stopped (or killed) when the test ends, however it ends."""
    started: list[Child] = []

    def start(bootstrap: list[str]) -> Child:
        child = Child(bootstrap)
        started.append(child)
        child.wait_ready()
        return child

    try:
        yield start
    finally:
        for child in started:
            child.close()


def test_entry_published_in_one_process_is_read_in_another(spawn: Callable[[list[str]], Child]) -> None:
    seed = spawn([])
    publisher = spawn([f"127.0.0.1:{seed.port}"])
    reader = spawn([f"localhost:{seed.port}"])
    children = [seed, publisher, reader]
    key, value = "swarmnode/run-x/snapshots", {"addr": "127.0.0.1:50051", "steps": 12}

    assert publisher.ask(op="publish", key=key, value=value, ttl_s=60) == {"ok": True}
    deadline = time.monotonic() + 10
    while (answer := reader.ask(op="get", key=key))["entries"] != {publisher.node_id: value}:
        assert time.monotonic() < deadline, f"reader never saw the entry: {answer}"
        time.sleep(0.05)
    assert answer["peers"] == 2
    for child in children:
        child.close()
        assert child.process.returncode == 0
