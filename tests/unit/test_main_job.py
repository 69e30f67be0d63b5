"""The main job's life with toy roles (child processes of a few lines) and a stand-in
for the servers: what a stop signal, or a role that dies, leaves behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.errors import InfraError, StartError
from infra.main_job import STOP_SIGNALS, check_free_to_run, run_main_job
from infra.process import process_alive, start_time
from infra.role_pids import RolePids
from infra.roles import RoleProcess, prune_role_logs
from tandoor.settings import Settings

TOY = """
import sys, time
print("toy ready", flush=True)
print("metrics on http://127.0.0.1:1/metrics", flush=True)
time.sleep(float(sys.argv[1]))
"""


class ToyRole(RoleProcess):
    module = "toy_role"

    def __init__(self, tmp_path: Path, name: str, lives_s: float) -> None:
        env = {"PYTHONPATH": str(tmp_path)}
        super().__init__(name, [str(lives_s)], "toy ready", tmp_path, env)


class Servers:
    def __init__(self) -> None:
        self.downs: list[bool] = []
        self.died: str | None = None

    def up(self) -> None:
        pass

    def down(self, started_only: bool = False) -> None:
        self.downs.append(started_only)

    def gone(self) -> str | None:
        return self.died


@pytest.fixture
def toys(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "toy_role.py").write_text(TOY)
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield tmp_path
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def signal_when_ready(roles: list[ToyRole], sig: signal.Signals) -> None:
    def send() -> None:
        while not all("toy ready" in role.log() for role in roles):
            threading.Event().wait(0.05)
        os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_every_role_and_only_the_servers_it_started(
    toys: Path, sig: signal.Signals
) -> None:
    """A closed terminal (SIGHUP) ended the job with no teardown: every role ran on."""
    roles = [ToyRole(toys, "a", 600), ToyRole(toys, "b", 600)]
    servers = Servers()
    said: list[str] = []
    signal_when_ready(roles, sig)
    code = run_main_job(servers, roles, lambda: None, lambda: None, said.append, 0.05)
    assert code == 0
    assert not any(role.alive for role in roles)
    assert servers.downs == [True]  # a stack someone had up before is theirs
    assert f"{sig.name}: stopping…" in said


FAILS_ON_STOP = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
print("toy ready", flush=True)
time.sleep(600)
"""


def test_a_role_that_fails_as_it_stops_makes_the_job_fail(toys: Path) -> None:
    """Its exit code was dropped: a worker that failed its drain (prompts not handed
    back) ended a job that said 0."""
    (toys / "failing_role.py").write_text(FAILS_ON_STOP)
    failing = ToyRole(toys, "failing", 0)
    failing.module = "failing_role"
    roles = [ToyRole(toys, "steady", 600), failing]
    said: list[str] = []
    signal_when_ready(roles, signal.SIGTERM)
    code = run_main_job(Servers(), roles, lambda: None, lambda: None, said.append, 0.05)
    assert code == 1 and not any(role.alive for role in roles)
    assert "error: failing (code 1) did not stop cleanly" in said


def test_a_stop_signal_during_start_up_stops_what_has_started(toys: Path) -> None:
    roles = [ToyRole(toys, "a", 600)]
    servers = Servers()

    def prepare() -> None:  # the bootstrap, slow: the signal arrives in the middle of it
        os.kill(os.getpid(), signal.SIGHUP)
        threading.Event().wait(5)

    code = run_main_job(servers, roles, prepare, lambda: None, lambda _: None, 0.05)
    assert code == 0
    assert roles[0].proc is None  # never started
    assert servers.downs == [True]


def test_a_role_that_dies_ends_the_job_loudly_and_stops_the_rest(toys: Path) -> None:
    roles = [ToyRole(toys, "steady", 600), ToyRole(toys, "short-lived", 1)]
    said: list[str] = []
    code = run_main_job(Servers(), roles, lambda: None, lambda: None, said.append, 0.05)
    assert code == 1
    assert not roles[0].alive
    assert any(line.startswith("error: short-lived exited (code 0)") for line in said)


def test_a_server_that_dies_ends_the_job_loudly_and_stops_the_roles(toys: Path) -> None:
    """Kafka killed under a running job: the roles only retried, and the job looked up."""
    roles = [ToyRole(toys, "steady", 600)]
    servers = Servers()
    said: list[str] = []

    def kafka_dies() -> None:
        while "toy ready" not in roles[0].log():
            threading.Event().wait(0.05)
        servers.died = "kafka exited; log kafka.log"

    threading.Thread(target=kafka_dies, daemon=True).start()
    code = run_main_job(servers, roles, lambda: None, lambda: None, said.append, 0.05)
    assert code == 1
    assert not roles[0].alive and servers.downs == [True]
    assert "error: kafka exited; log kafka.log" in said


STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("toy ready", flush=True)
time.sleep(600)
"""


def test_a_role_that_ignores_sigterm_is_killed_and_the_teardown_goes_on(toys: Path) -> None:
    """It raised TimeoutExpired out of the teardown, and the servers the job started
    were left running."""
    (toys / "stubborn_role.py").write_text(STUBBORN)
    role = ToyRole(toys, "stubborn", 0)
    role.module = "stubborn_role"
    role.start()
    while "toy ready" not in role.log():
        threading.Event().wait(0.05)
    assert role.terminate(timeout_s=0.5) == -signal.SIGKILL
    assert not role.alive


async def test_a_role_that_fails_to_start_names_its_log(toys: Path) -> None:
    (toys / "broken_role.py").write_text("raise SystemExit('no config')\n")
    role = ToyRole(toys, "broken", 0)
    role.module = "broken_role"
    role.start()
    with pytest.raises(
        StartError, match=f"broken exited during start-up \\(log {role.log_file}\\)"
    ):
        await role.wait_ready()


KILLED_JOB = """
import sys
from pathlib import Path
from infra.main_job import run_main_job
from infra.role_pids import RolePids
from infra.roles import RoleProcess, prune_role_logs

toys = Path(sys.argv[1])


class Toy(RoleProcess):
    module = "toy_role"


class NoServers:
    def up(self): pass
    def down(self, started_only=False): pass
    def gone(self): return None


role = Toy("orphan", ["600"], "toy ready", toys, {"PYTHONPATH": str(toys)})
announce = lambda: print("job up", flush=True)
run_main_job(NoServers(), [role], lambda: None, announce, print, 0.05, RolePids(toys / "run"))
"""


def test_roles_of_a_killed_job_are_stopped_by_the_next_one(toys: Path) -> None:
    """kill -9 of `tandoor run` left its roles running unseen (each in its own session):
    the gateway's port taken, a worker's GBs held, and `infra down` knew of none."""
    (toys / "killed_job.py").write_text(KILLED_JOB)
    job = subprocess.Popen(
        [sys.executable, str(toys / "killed_job.py"), str(toys)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert job.stdout is not None
    while b"job up" not in job.stdout.readline():
        assert job.poll() is None, "the job ended before its roles were up"
    pids = RolePids(toys / "run")
    (noted,) = pids.noted()
    assert pids.stop_orphans() == [], "the job runs: its roles are its own"
    assert pids.running_job() == job.pid  # a second run is refused meanwhile
    job.kill()
    job.wait()
    job.stdout.close()
    assert process_alive(noted.pid), "the role outlived its job"
    assert pids.stop_orphans() == [noted.name]
    assert not process_alive(noted.pid) and pids.noted() == []
    assert pids.running_job() is None


def test_each_run_prunes_the_role_logs_of_earlier_runs_but_the_newest(tmp_path: Path) -> None:
    """Every run wrote new logs (`<role>-<id>.log`) and none was removed: a disk that
    filled with them, run after run."""
    for age, hex_id in enumerate(["aaaaa1", "aaaaa2", "aaaaa3", "aaaaa4", "aaaaa5"]):
        old = tmp_path / f"gateway-{hex_id}.log"
        old.write_text("earlier run")
        os.utime(old, (1_000 + age, 1_000 + age))
    (tmp_path / "gateway-spare.log").write_text("not a role log: kept")
    (tmp_path / "persist-bbbbb1.log").write_text("another role's: kept")
    gateway = ToyRole(tmp_path, "gateway", 0)
    prune_role_logs([gateway], running={"gateway-aaaaa1"}, keep=3)  # another job's, live
    left = sorted(path.name for path in tmp_path.glob("*.log"))
    assert left == [
        "gateway-aaaaa1.log",
        "gateway-aaaaa3.log",
        "gateway-aaaaa4.log",
        "gateway-aaaaa5.log",
        "gateway-spare.log",
        "persist-bbbbb1.log",
    ]


def test_a_second_run_or_a_taken_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A second `tandoor run` with the same home started every role again (a second
    worker per model joining the first run's groups), and a gateway port held by another
    program was found only when the gateway failed to bind, after minutes of start-up:
    either ended in a gateway log tail that named neither."""
    pids = RolePids(tmp_path / "run")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = Settings(gateway_port=taken.getsockname()[1])
        with pytest.raises(InfraError, match=r"\(TANDOOR_GATEWAY_PORT\) is taken"):
            check_free_to_run(settings, pids)
    check_free_to_run(settings, pids)  # the port free again
    pids.dir.mkdir(parents=True)
    job = os.getppid()  # a process that runs: the job that noted this role
    line = f"{os.getpid()} {start_time(os.getpid())} {job} {start_time(job)}"
    (pids.dir / "gateway-1.pid").write_text(line)
    with pytest.raises(InfraError, match=rf"a `tandoor run` \(pid {job}\) is already running"):
        check_free_to_run(settings, pids)
