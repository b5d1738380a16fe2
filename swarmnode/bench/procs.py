"""Child processes, the one harness the demo, the benches and the tests share: real `swarmnode run`
nodes (`NodeProcess`), the benches' workers that answer JSON lines (`Worker`, `bench/worker.py`), and
the one poll helper (`wait_until`).

Each child runs in a session of its own, without the caller's SWARMNODE_* settings, and is SIGKILLed
with its whole process group when its `with` block ends (or by `kill()`), on every way out; its output
goes to a log file whose tail comes with any failure. A caller that is itself SIGKILLed (a bench killed
by a test's timeout) runs none of that, so each child also gets SIGKILL from the kernel when its parent
dies (`PR_SET_PDEATHSIG`). Linux sends it when the *thread* that started the child ends: start a child
from the thread that owns it for its whole life (the main thread, or a worker thread whose `with` block
holds it: every caller here does one or the other).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.request import urlopen

T = TypeVar("T")

LOOPBACK_ARGS = (
    *("--host", "127.0.0.1", "--grpc-port", "0", "--dht-port", "0", "--metrics-port", "0"),
    *("--reachable", "yes"),
)
"""`swarmnode run` flags for nodes this code starts itself (demo, benches, tests): loopback, free ports,
and reachable (on loopback every node reaches every other; a later `--reachable` overrides it)."""
NODE_ARGS = (*LOOPBACK_ARGS, "--progress-interval", "3600")
"""`swarmnode run` flags every bench node gets: loopback, ports picked by the OS, no progress lines."""


_peak_rss_mb = {"largest child": 0.0}


def largest_child_rss_mb() -> float:
    """The largest peak RSS (VmHWM) of the children killed so far in this process (0: none)."""
    return _peak_rss_mb["largest child"]


def peak_rss_mb(pid: int) -> float:
    """A live process's peak RSS (VmHWM) in MB, 0 if it is gone (`ru_maxrss` of children would count
    this process's own peak too: Linux carries the parent's high-water mark into a child across fork
    and exec)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), "VmHWM: 0 kB")
    return int(line.split()[1]) / 1024


def _record_peak_rss(pid: int) -> None:
    _peak_rss_mb["largest child"] = max(_peak_rss_mb["largest child"], peak_rss_mb(pid))


_SAMPLE = re.compile(r"^(swarmnode_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The Prometheus exposition at `url` (OSError if it cannot be read)."""
    with urlopen(url, timeout=timeout_s) as reply:
        text: str = reply.read().decode()
        return text


def samples(text: str) -> dict[str, float]:
    """A Prometheus exposition's swarmnode_* samples, labelled ones summed per name (NaNs left out)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(3) != "NaN":
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(3))
    return found


def metric_value(text: str, name: str, labels: str = "") -> float:
    """One sample's value from a Prometheus exposition, `labels` its exact label set (0 when absent)."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def child_env() -> dict[str, str]:
    """This environment without SWARMNODE_* settings: a volunteer's own (--peers, --data-dir, a token…)
    must not reach a bench's nodes, which would then join their real swarm or write into their data."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMNODE_")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines file that a child may be appending to ([] if none yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    """A port that is free on 127.0.0.1 now (for a child that others must know before it listens)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ChildFailed(RuntimeError):
    """A child process died, said something malformed, or did not answer in time."""


def wait_until(predicate: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.02) -> T:
    """Polls `predicate()` until it returns something truthy; ChildFailed after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ChildFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child only calls it


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A `preexec_fn`: SIGKILL when the parent (the thread that forks) ends, and at once if the parent
    already died before the setting took (the child would then be an orphan nobody kills)."""

    def preexec() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def stop_all(children: Sequence[_Child], timeout_s: float) -> list[int]:
    """SIGTERM to every child at once, then each one's exit code; one still running `timeout_s` after
    the signal is SIGKILLed (its code: -SIGKILL). The codes in `children`'s order."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    codes = []
    for child in children:
        assert child.proc is not None
        try:
            code = child.proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            child.kill()
            code = child.proc.returncode
        codes.append(code)
    return codes


class _Child:
    """A started process in its own session, killed (with its group) by `kill()` or the `with` block,
    and by the kernel when the thread that started it ends (its parent SIGKILLed)."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None

    def _start(self, argv: Sequence[str], piped: bool, env: dict[str, str] | None = None) -> None:
        """Starts `argv`; `piped`: stdin and stdout are pipes to this process, else both go to the log."""
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
                stdout=subprocess.PIPE if piped else log,
                stderr=log if piped else subprocess.STDOUT,
                text=True,
                start_new_session=True,
                env=env or child_env(),
                preexec_fn=_die_with_parent(os.getpid()),
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        """The exit code once the process has ended (negative: the signal that ended it), else None."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL to the child's process group (only while the child is not yet reaped, so its id is
        still ours), then reap it."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            _record_peak_rss(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def signal(self, sig: int) -> None:
        """Sends `sig` to the child's process group while the child is not yet reaped."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float = 120.0) -> int:
        """The exit code; ChildFailed (the process killed) if it has not ended within `timeout_s`."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self.fail(f"did not exit within {timeout_s:.0f} s") from None

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP), from /proc."""
        assert self.proc is not None
        try:
            return (Path("/proc") / str(self.proc.pid) / "stat").read_text().split()[2] == "T"
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:]

    def fail(self, why: str) -> ChildFailed:
        return ChildFailed(f"{why}; log {self.log_path}:\n{self.log_tail()}")

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()


class Worker(_Child):
    """`python -m swarmnode.bench.worker ROLE ARGS…`: one JSON object per line each way."""

    def __init__(self, log_dir: Path, role: str, *args: str) -> None:
        super().__init__(log_dir / f"worker-{role}-{time.monotonic_ns()}.log")
        self.argv = [sys.executable, "-m", "swarmnode.bench.worker", role, *args]

    def __enter__(self) -> Worker:
        self._start(self.argv, piped=True)
        return self

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self.fail("worker exited") from None

    def read(self, timeout_s: float) -> dict[str, Any]:
        """The worker's next line (one reply per request, so nothing waits in Python's buffer)."""
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else None
        if line is None:
            raise self.fail(f"no answer within {timeout_s:.0f} s")
        if not line:
            raise self.fail(f"worker exited with {self.proc.wait(10)}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise self.fail(f"worker failed: {reply['error']}")
        return reply

    def ask(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.send(message)
        return self.read(timeout_s)


class NodeProcess(_Child):
    """A `swarmnode run` child with its own data dir: `base_args` (loopback, free ports, no progress
    lines), `--data-dir`, then `args`. Restarts append to the same log; `faults` sets SWARMNODE_FAULTS;
    `prefix` runs it through another command (e.g. `ip netns exec NAME`)."""

    def __init__(
        self,
        data_dir: Path,
        args: Sequence[str] = (),
        *,
        faults: str | None = None,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
        base_args: Sequence[str] = NODE_ARGS,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(self.data_dir / f"node-{time.time_ns() // 1_000_000}.log")
        self.prefix = list(prefix)
        self.args = [*base_args, "--data-dir", str(self.data_dir), *args]
        self.env = {**child_env(), **(env or {})}
        if faults:
            self.env["SWARMNODE_FAULTS"] = faults

    def __enter__(self) -> NodeProcess:
        return self.start()

    def start(self) -> NodeProcess:
        (self.data_dir / "node.json").unlink(missing_ok=True)
        self._start([*self.prefix, sys.executable, "-m", "swarmnode.cli", "run", *self.args], False, self.env)
        return self

    def restart(self, faults: str | None = None) -> NodeProcess:
        """Starts again with the same arguments, and these faults (by default none)."""
        self.env.pop("SWARMNODE_FAULTS", None)
        if faults:
            self.env["SWARMNODE_FAULTS"] = faults
        return self.start()

    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """DATA_DIR/node.json, once the node's services listen; ChildFailed if it exits first."""

        def ready() -> bool:
            if not self.alive():
                raise self.fail(f"node exited with {self.exit_code()} before it listened")
            return (self.data_dir / "node.json").exists()

        wait_until(ready, timeout_s, f"node in {self.data_dir} to listen")
        return self.info

    @property
    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = json.loads((self.data_dir / "node.json").read_text())
        return info

    @property
    def grpc_address(self) -> str:
        return f"{self.info['host']}:{self.info['grpc_port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.info['host']}:{self.info['metrics_port']}/metrics"

    def metrics(self, timeout_s: float = 10.0) -> str:
        """The node's Prometheus exposition (OSError if it cannot be read)."""
        return scrape(self.metrics_url, timeout_s)

    @property
    def snapshot_dir(self) -> Path:
        return self.data_dir / "snapshots"
