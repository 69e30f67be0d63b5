"""ServerProcess against real child processes (a tiny Python script stands in for a server)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from infra.errors import StartError
from infra.process import ServerProcess, free_port, log_contains, outgoing_ports


def server(tmp_path: Path) -> ServerProcess:
    return ServerProcess("toy", tmp_path / "run", tmp_path / "logs" / "toy.log")


def test_launch_wait_and_terminate(tmp_path: Path) -> None:
    proc = server(tmp_path)
    script = "import time; print('toy ready', flush=True); time.sleep(60)"
    pid = proc.launch([sys.executable, "-c", script], cwd=tmp_path)
    proc.wait_ready(lambda: log_contains(proc.log_file, "toy ready"), timeout_s=10)
    assert proc.pid() == pid
    assert proc.terminate(grace_s=5) is True
    assert proc.pid() is None
    assert proc.terminate(grace_s=5) is False  # safe to call twice


def test_a_server_that_dies_at_start_reports_its_log_tail(tmp_path: Path) -> None:
    proc = server(tmp_path)
    script = "import sys; print('bad config: port must be a number', flush=True); sys.exit(3)"
    proc.launch([sys.executable, "-c", script], cwd=tmp_path)
    with pytest.raises(StartError, match="exited during start-up") as info:
        proc.wait_ready(lambda: False, timeout_s=10)
    assert "bad config: port must be a number" in str(info.value)


def test_a_stalled_server_times_out_with_its_log_tail(tmp_path: Path) -> None:
    proc = server(tmp_path)
    proc.launch(
        [sys.executable, "-c", "import time; print('warming up', flush=True); time.sleep(60)"],
        cwd=tmp_path,
    )
    try:
        with pytest.raises(StartError, match="not ready within 1 s") as info:
            proc.wait_ready(lambda: False, timeout_s=1)
        assert "warming up" in str(info.value)
    finally:
        proc.terminate(grace_s=5)


def test_a_previous_run_log_does_not_count_as_ready(tmp_path: Path) -> None:
    proc = server(tmp_path)
    proc.log_file.parent.mkdir(parents=True)
    proc.log_file.write_text("toy ready\n")
    proc.launch([sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path)
    try:
        assert not log_contains(proc.log_file, "toy ready")
    finally:
        proc.terminate(grace_s=5)


@pytest.mark.parametrize("recorded", ["{pid}", "{pid} 1"])
def test_a_pid_file_naming_another_program_is_stale_and_that_program_is_left_alone(
    tmp_path: Path, recorded: str
) -> None:
    """After a reboot the pid in a pid file may be someone else's: `infra down` killed its
    process group, `infra up` took it for the server and waited on it."""
    stranger = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        proc = server(tmp_path)
        proc.pid_file.parent.mkdir(parents=True)
        proc.pid_file.write_text(recorded.format(pid=stranger.pid))
        assert proc.pid() is None
        assert proc.terminate(grace_s=1) is False
        assert stranger.poll() is None  # not signalled
        assert not proc.pid_file.exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_a_server_started_by_an_earlier_version_is_still_ours(tmp_path: Path) -> None:
    """Its pid file holds a pid alone: taken as stale, the server ran on unstoppable, and
    the next start found its port taken."""
    data = tmp_path / "data" / "toy"
    data.mkdir(parents=True)
    earlier = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], cwd=data, start_new_session=True
    )
    try:
        proc = server(tmp_path)
        proc.pid_file.parent.mkdir(parents=True)
        proc.pid_file.write_text(str(earlier.pid))
        assert proc.pid() == earlier.pid
        assert proc.terminate(grace_s=5) is True
        assert earlier.wait(timeout=10) is not None
    finally:
        earlier.kill()
        earlier.wait()


def test_free_ports_lie_below_the_range_of_outgoing_connections() -> None:
    """Port 0's pick came from that range: a client connection the child made before it
    listened (the gateway's to Kafka) took the port, and its start failed."""
    low, _ = outgoing_ports()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), sorted(ports)
    for port in ports:  # free to listen on
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_a_free_port_is_found_where_outgoing_connections_use_every_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host tuned to "1024 65535" left nothing below the range: an empty-range error
    failed every test that asked for a port."""
    monkeypatch.setattr("infra.process.outgoing_ports", lambda: (1024, 65535))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", free_port()))


def test_a_pid_file_that_cannot_be_written_stops_the_server_it_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk: the server started, its pid file failed to write, and the run ended
    in a traceback with the server running untracked (the next run found its port
    taken by "a process Tandoor did not start", and `infra down` knew nothing of it)."""
    proc = server(tmp_path)
    launched: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def recorded(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        launched.append(popen(*args, **kwargs))  # type: ignore[call-overload]
        return launched[-1]

    def disk_full(*_: object, **__: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(subprocess, "Popen", recorded)
    monkeypatch.setattr(Path, "write_text", disk_full)
    script = "import time; time.sleep(60)"
    with pytest.raises(StartError, match=r"toy: cannot write .*No space left on device"):
        proc.launch([sys.executable, "-c", script], cwd=tmp_path)
    (child,) = launched
    assert child.wait(timeout=10) is not None  # stopped, not left running
