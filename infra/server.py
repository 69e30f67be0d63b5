"""A local server that `tandoor infra` fetches, starts, checks and stops."""

from __future__ import annotations

import fcntl
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from infra.errors import StartError
from infra.process import ServerProcess, port_open
from tandoor.settings import Settings

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class ServerStatus:
    name: str
    address: str
    pid: int | None
    ready: bool

    def describe(self) -> str:
        state = "ready" if self.ready else ("starting" if self.pid else "stopped")
        pid = f"pid {self.pid}" if self.pid else "no process"
        return f"{self.name:<10} {self.address:<22} {state:<9} {pid}"


class LocalServer(ABC):
    name: str
    stop_grace_s: float = 30.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.data_dir = settings.home / "data" / self.name
        self.conf_dir = settings.home / "conf" / self.name
        self.process = ServerProcess(
            self.name, settings.home / "run", settings.home / "logs" / f"{self.name}.log"
        )

    @property
    @abstractmethod
    def port(self) -> int: ...

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    @abstractmethod
    def fetch(self) -> None:
        """Install what the server needs to run; cached, so a second call is quick."""

    @abstractmethod
    def prepare(self) -> list[str]:
        """Write configuration, initialise storage; return the command line to run."""

    @abstractmethod
    def is_ready(self) -> bool: ...

    def launch(self) -> bool:
        """Start the server unless it runs already. True if it was started now. One
        launch at a time: two `infra up` at once both found no pid file and both started
        one, and `infra down` then stopped only the one its pid file named."""
        lock_file = self.process.pid_file.with_suffix(".lock")
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        with lock_file.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return self._launch_unless_running()

    def _launch_unless_running(self) -> bool:
        if self.process.pid() is not None:
            self._check_address()
            return False
        if port_open(self.settings.host, self.port):
            raise StartError(
                f"{self.name}: port {self.address} is taken by a process Tandoor did not "
                f"start; stop it or choose another port (TANDOOR_*_PORT)"
            )
        self.fetch()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        self.process.launch(self.prepare(), cwd=self.data_dir)
        self._address_file.write_text(self.address)
        return True

    @property
    def _address_file(self) -> Path:
        return self.process.pid_file.with_suffix(".address")

    def _check_address(self) -> None:
        """The running server listens where these settings look for it: started with
        another port or host, it was waited on for the whole start timeout (180 s),
        then said not ready above a log of a healthy server."""
        if not self._address_file.exists():  # started before addresses were noted
            return
        running = self._address_file.read_text().strip()
        if running != self.address:
            raise StartError(
                f"{self.name} runs on {running}, started with other settings than these "
                f"({self.address}): stop it first (`tandoor infra down` with those settings)"
            )

    def wait_ready(self) -> None:
        self.process.wait_ready(self.is_ready, self.settings.start_timeout_s)

    def stop(self) -> bool:
        return self.process.terminate(self.stop_grace_s)

    def status(self) -> ServerStatus:
        pid = self.process.pid()
        return ServerStatus(self.name, self.address, pid, pid is not None and self.is_ready())

    def render(self, template: str, target: str, **values: object) -> Path:
        path = self.conf_dir / target
        path.write_text((TEMPLATES / template).read_text().format(**values))
        return path
