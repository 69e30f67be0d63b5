"""LocalServer's launch against real child processes (a sleeping Python stands in for a
server): two `infra up` at once, and one with other settings than the running server's."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from infra.errors import StartError
from infra.process import free_port
from infra.server import LocalServer
from tandoor.settings import Settings


class ToyServer(LocalServer):
    name = "toy"

    def __init__(self, settings: Settings, port: int) -> None:
        super().__init__(settings)
        self._port = port

    @property
    def port(self) -> int:
        return self._port

    def fetch(self) -> None:
        time.sleep(0.3)  # checking the cache: the other `up` reads the pid file meanwhile

    def prepare(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    def is_ready(self) -> bool:
        return True


def test_two_ups_at_once_start_one_server(tmp_path: Path) -> None:
    """Both saw no pid file and both launched: two servers on one data folder, the pid
    file naming one of them, and `infra down` blind to the other."""
    settings = Settings(home=tmp_path)
    port = free_port()
    servers = [ToyServer(settings, port), ToyServer(settings, port)]
    launched: dict[int, bool] = {}
    ups = [
        threading.Thread(target=lambda n=n: launched.update({n: servers[n].launch()}))
        for n in range(2)
    ]
    for up in ups:
        up.start()
    for up in ups:
        up.join()
    try:
        assert sorted(launched.values()) == [False, True]
    finally:  # the one that launched reaps its child
        for n in sorted(launched, key=lambda n: not launched[n]):
            servers[n].stop()


def test_a_server_running_on_another_port_is_said_at_once(tmp_path: Path) -> None:
    """Started with other settings (TANDOOR_KAFKA_PORT changed since): `infra up` waited
    the whole start timeout on the new port, then said the server was not ready."""
    settings = Settings(home=tmp_path)
    running = ToyServer(settings, free_port())
    assert running.launch()
    try:
        moved = ToyServer(settings, free_port())
        with pytest.raises(StartError, match=f"toy runs on {running.address}, started with"):
            moved.launch()
        assert not running.launch()  # the same settings: found running, nothing said
    finally:
        running.stop()
