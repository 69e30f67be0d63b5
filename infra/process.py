"""A detached server process: launched in its own session, tracked by a pid file."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from infra.errors import StartError

PORT_SPAN = 12_000  # ports below the outgoing range that free_port picks from
PORT_TRIES = 50


class ServerProcess:
    def __init__(self, name: str, run_dir: Path, log_file: Path) -> None:
        self.name = name
        self.pid_file = run_dir / f"{name}.pid"
        self.log_file = log_file
        self._child: subprocess.Popen[bytes] | None = None  # set when launched by this process

    def pid(self) -> int | None:
        """The pid of the running server, or None (a stale pid file is removed). The file
        holds the pid and the process's start time: after a reboot the pid may be another
        program's, which `infra down` would have killed and `infra up` waited on."""
        try:
            pid, *started = (int(field) for field in self.pid_file.read_text().split())
        except (FileNotFoundError, ValueError):
            return None
        if process_alive(pid) and (started == [start_time(pid)] or self._ours_of_old(pid, started)):
            return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def _ours_of_old(self, pid: int, started: list[int]) -> bool:
        """A pid file of an earlier version (a pid alone): the server is taken for ours
        if it runs in this home's data folder, where every server is started."""
        if started:
            return False
        home = self.pid_file.parent.parent
        with contextlib.suppress(OSError):
            return Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(home / "data")
        return False

    def launch(self, argv: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> int:
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        if self.log_file.exists():  # keep one previous run; readiness reads only this one
            self.log_file.replace(self.log_file.with_suffix(".previous.log"))
        with self.log_file.open("wb") as log:
            proc = subprocess.Popen(
                list(argv),
                cwd=cwd,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives the CLI; Ctrl-C is ours to forward
            )
        try:
            self.pid_file.write_text(f"{proc.pid} {start_time(proc.pid)}")
        except OSError as exc:  # a full disk, say: not left running untracked
            stop_group(proc.pid, 5)
            proc.wait()
            with contextlib.suppress(OSError):
                self.pid_file.unlink(missing_ok=True)
            raise StartError(f"{self.name}: cannot write {self.pid_file} ({exc})") from exc
        self._child = proc
        return proc.pid

    def terminate(self, grace_s: float) -> bool:
        """SIGTERM, then SIGKILL after `grace_s`. True if a process was running."""
        pid = self.pid()
        if pid is None:
            return False
        stop_group(pid, grace_s)
        if self._child is not None:
            self._child.wait()  # reap our own child
            self._child = None
        self.pid_file.unlink(missing_ok=True)
        return True

    def log_tail(self, lines: int = 40) -> str:
        try:
            with self.log_file.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return "(no log file)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float) -> None:
        """Poll `probe` until it holds; fail with the log's tail if the server dies or stalls."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if probe():
                return
            if self._exited():
                raise StartError(self._failure("exited during start-up"))
            time.sleep(0.25)
        raise StartError(self._failure(f"was not ready within {timeout_s:.0f} s"))

    def _exited(self) -> bool:
        if self._child is not None and self._child.poll() is not None:
            self._child = None
            self.pid_file.unlink(missing_ok=True)
            return True
        return self.pid() is None

    def _failure(self, what: str) -> str:
        return f"{self.name} {what}; log {self.log_file}, last lines:\n{self.log_tail()}"


def java() -> str:
    """The `java` Kafka and Cassandra run on, or a StartError that says where it comes
    from (a traceback of FileNotFoundError said nothing of Java)."""
    found = shutil.which("java")
    if found is None:
        raise StartError(
            "java is not on PATH: Kafka and Cassandra need a Java 17 runtime "
            "(scripts/bootstrap.sh installs openjdk-17-jre-headless)"
        )
    return found


def port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def log_contains(path: Path, needle: str) -> bool:
    try:
        return needle in path.read_text(errors="replace")
    except FileNotFoundError:
        return False


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own exited child not yet reaped) is not alive.
    with contextlib.suppress(FileNotFoundError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/PID/stat, field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields from the 3rd on, after the name


def stop_group(pid: int, grace_s: float) -> None:
    """SIGTERM the process group `pid` leads, then SIGKILL after `grace_s`."""
    _signal_group(pid, signal.SIGTERM)
    if not _wait_until(lambda: not process_alive(pid), grace_s):
        _signal_group(pid, signal.SIGKILL)
        _wait_until(lambda: not process_alive(pid), 10.0)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (for child processes of tests and benchmarks),
    below the kernel's range for outgoing connections: one from that range (what binding
    port 0 gives) was taken by a client connection, the child's own to Kafka or Redis
    among them, before the child listened, and its start failed "address already in use"."""
    below = outgoing_ports()[0]
    tries = PORT_TRIES if below - 1024 >= PORT_TRIES else 0  # none below it to pick from
    for _ in range(tries):
        port = random.randrange(max(1024, below - PORT_SPAN), below)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # all taken: the kernel's choice, as before
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def outgoing_ports() -> tuple[int, int]:
    """The range the kernel picks outgoing connections' local ports from."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
