"""Redis from Debian's package, on a project-local port and folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess

from infra.errors import FetchError
from infra.server import LocalServer


class RedisServer(LocalServer):
    name = "redis"
    stop_grace_s = 10.0

    @property
    def port(self) -> int:
        return self.settings.redis_port

    def fetch(self) -> None:
        if shutil.which("redis-server"):
            return
        if os.geteuid() != 0:
            raise FetchError("redis-server is missing: run `sudo apt-get install -y redis-server`")
        for argv in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "redis-server"],
        ):
            result = subprocess.run(argv, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise FetchError(f"{' '.join(argv)} failed:\n{result.stderr[-2000:]}")

    def prepare(self) -> list[str]:
        return [
            "redis-server",
            "--bind",
            self.settings.host,
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--appendonly",
            "yes",
            "--save",
            "",
            "--logfile",
            "",
        ]

    def is_ready(self) -> bool:
        with contextlib.suppress(OSError):
            with socket.create_connection((self.settings.host, self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        return False
