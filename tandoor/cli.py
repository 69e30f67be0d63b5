"""The `tandoor` command: one entry point for every role and for the local stack."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError

from infra.errors import InfraError
from schemas.events import ANSWERED
from tandoor.batch_cli import batch_app
from tandoor.lifecycle import serve
from tandoor.logs import configure_logging
from tandoor.settings import BATCH_BAND, Settings, get_settings

if TYPE_CHECKING:  # the local-server tooling: imported by the commands that use it only,
    # so a role's process (`tandoor worker`, ...) never loads it
    from infra.roles import RoleProcess
    from infra.stack import Stack

T = TypeVar("T")

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
infra_app = typer.Typer(no_args_is_help=True, help="Local Kafka, Cassandra and Redis.")
app.add_typer(infra_app, name="infra")
keys_app = typer.Typer(no_args_is_help=True, help="API keys.")
app.add_typer(keys_app, name="keys")
app.add_typer(batch_app, name="batch")


@app.callback()
def _setup(
    ctx: typer.Context, log_level: str = typer.Option("INFO", help="Python log level.")
) -> None:
    role = ctx.invoked_subcommand or "tandoor"
    try:
        settings = get_settings()
    except ValidationError as exc:  # one line per problem, not a traceback
        problems = "\n".join(
            f"  {'.'.join(map(str, e['loc'])) or 'TANDOOR_*'}: {e['msg']}" for e in exc.errors()
        )
        typer.secho(f"configuration error (TANDOOR_*):\n{problems}", err=True, fg="red")
        raise typer.Exit(2) from None
    except SettingsError as exc:  # a value that is not JSON where JSON is expected
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        typer.secho(f"configuration error (TANDOOR_*): {exc}{cause}", err=True, fg="red")
        raise typer.Exit(2) from None
    configure_logging(log_level.upper(), role, settings.log_format)


def _stack() -> Stack:
    from infra.stack import Stack

    return Stack(get_settings())


@infra_app.command("fetch")
def infra_fetch() -> None:
    """Download what the servers need (cached; quick the second time)."""
    for server in _stack().servers:
        _guard(server.fetch)


@infra_app.command("up")
def infra_up(
    skip_bootstrap: bool = typer.Option(False, help="Do not create topics and tables."),
) -> None:
    """Start the servers that are not running, wait until ready, then bootstrap."""
    stack = _stack()
    _guard(stack.up)
    if not skip_bootstrap:
        _bootstrap()
    _print_status(stack)


@infra_app.command("down")
def infra_down() -> None:
    """Stop every server this project started, and roles a killed `tandoor run` left
    running (safe to run twice)."""
    from infra.role_pids import RolePids

    stack = _stack()
    for orphan in RolePids(stack.settings.home / "run").stop_orphans():
        typer.echo(f"stopped {orphan}: left running by a job that was killed")
    stack.down()


@infra_app.command("status")
def infra_status() -> None:
    """Show each server; exit 1 unless all are ready."""
    if not _print_status(_stack()):
        raise typer.Exit(1)


@app.command("bootstrap")
def bootstrap_command() -> None:
    """Create the declared topics and apply CQL migrations (idempotent)."""
    _bootstrap()


@app.command("run")
def run() -> None:
    """The main job: servers, a worker per model, persistence, batch admission, streams,
    gateway; Ctrl-C stops all."""
    from infra.main_job import check_free_to_run, run_main_job
    from infra.role_pids import RolePids
    from infra.roles import (
        AdmissionProcess,
        GatewayProcess,
        PersistProcess,
        StreamsProcess,
        WorkerProcess,
    )
    from infra.stack import Stack

    settings = get_settings()
    tier = _guard(lambda: local_tier(settings))  # before anything starts: its key's tier
    if settings.analytics_token is None:  # this run's, for reading the rollups
        settings = settings.model_copy(update={"analytics_token": secrets.token_urlsafe(24)})
    stack = Stack(settings)
    logs = settings.home / "logs"
    roles: list[RoleProcess] = [WorkerProcess(m, logs, {}) for m in settings.models]
    roles.append(PersistProcess(logs, {}))
    roles.append(AdmissionProcess(logs, {}))
    roles.append(StreamsProcess(logs, {"TANDOOR_ANALYTICS_TOKEN": str(settings.analytics_token)}))
    roles.append(GatewayProcess(logs, settings.gateway_port, {}))

    def announce() -> None:
        _print_status(stack)
        from tandoor.policies.api_keys import create_key

        key, _ = asyncio.run(create_key(settings, "local", tier))
        address = f"http://{settings.host}:{settings.gateway_port}"
        typer.echo(f"chat page: {address}/")
        typer.echo(f"API: {address}/v1 (API key {key})")
        rollups = f"http://{settings.host}:{settings.streams_web_port}/rollups/user/local"
        bearer = f"Authorization: Bearer {settings.analytics_token}"
        typer.echo(f"usage rollups: curl -H '{bearer}' {rollups}")
        typer.echo('Tandoor is up. Try: .venv/bin/tandoor ask "What is the capital of France?"')
        typer.echo("Press Ctrl-C to stop everything.")

    pids = RolePids(settings.home / "run")
    _guard(lambda: check_free_to_run(settings, pids))
    job = lambda: run_main_job(stack, roles, _bootstrap, announce, typer.echo, pids=pids)  # noqa: E731
    code = _guard(job)
    raise typer.Exit(code)


@app.command("worker")
def worker(
    model: str = typer.Option("smollm2", help="Served model: its name in TANDOOR_MODELS."),
) -> None:
    """An inference worker: prompts.<model> from Kafka into vLLM, token events out."""
    from workers.model_check import ModelError, prepare_engine
    from workers.worker import Worker, WorkerFailed  # imports vLLM: only here

    try:
        settings = get_settings()
        options = prepare_engine(settings, model)  # before any connection: a clear error
        asyncio.run(serve(lambda: Worker(settings, model, options)))
    except (WorkerFailed, ModelError) as exc:
        typer.secho(f"worker failed: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from exc


@app.command("ask")
def ask(
    text: str,
    model: str = typer.Option("smollm2"),
    band: str = typer.Option("interactive-paid"),
    max_tokens: int = typer.Option(256, min=1),
) -> None:
    """Send one prompt through Kafka and a worker; print the reply as it streams."""
    from producers.ask import ask as ask_once

    settings = get_settings()
    # Checked before connecting: an unknown model waited 40 s for its topic, then
    # blamed the stack; an unknown band was a traceback.
    if model not in settings.models:
        raise typer.BadParameter(f"no model {model!r}; served: {sorted(settings.models)}")
    if band not in (bands := [b.name for b in settings.bands]):
        raise typer.BadParameter(f"no band {band!r}; bands: {bands}")
    final = _stack_guard(lambda: asyncio.run(ask_once(settings, text, model, band, max_tokens)))
    usage = final.usage
    typer.echo(
        f"[{final.finish_reason}] {usage.prompt_tokens} prompt + {usage.completion_tokens} "
        f"completion tokens, first token after {usage.ttft_ms or 0:.0f} ms"
        + (f"; {final.error}" if final.error else "")
    )
    if final.finish_reason not in ANSWERED:  # a script's smoke test must see it failed
        raise typer.Exit(1)


@app.command("gateway")
def gateway(port: int = typer.Option(0, help="Default: TANDOOR_GATEWAY_PORT (8000).")) -> None:
    """The HTTP gateway (FastAPI) on 127.0.0.1; SIGTERM drains it."""
    from producers.gateway.server import serve_gateway

    settings = get_settings()
    serve_gateway(settings, port or settings.gateway_port)


@app.command("persist")
def persist() -> None:
    """The persistence consumer: finished replies and usage into Cassandra."""
    from consumers.persist import Persister

    asyncio.run(serve(lambda: Persister(get_settings())))


@app.command("admission")
def admission() -> None:
    """Batch admission: lines from `batch.requests` checked, charged and forwarded fairly
    into the batch band; refused lines answered on `batch.results`."""
    from producers.admission.role import Admission

    asyncio.run(serve(lambda: Admission(get_settings())))


@app.command("streams")
def streams() -> None:
    """Usage rollups per user and model (faust-streaming), over HTTP on 127.0.0.1:6066."""
    from faust import Worker

    from infra.topics import ensure_topics
    from streams.app import by_model_topic, create_app, partitions_refused

    settings = get_settings()
    if refused := asyncio.run(partitions_refused(settings)):
        typer.secho(f"error: {refused}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    asyncio.run(ensure_topics(settings.kafka_bootstrap, [by_model_topic(settings)]))
    # Our handlers kept (JSON, role, the flood limit): faust replaced them with its own.
    level = logging.getLevelName(logging.getLogger().level)
    worker = Worker(create_app(settings), loglevel=level, override_logging=False)
    worker.spinner = None  # a terminal's: it said "OK ^" in place of logging "Ready"
    worker.execute_from_commandline()


@keys_app.command("create")
def keys_create(
    user: str = typer.Option(..., help="The user the key acts for."),
    tier: str = typer.Option("free", help="free, plus, api or batch (TANDOOR_TIERS)."),
) -> None:
    """Create an API key; the key is printed once, as the last line, and stored hashed."""
    from tandoor.policies.api_keys import create_key

    try:
        key, principal = _stack_guard(lambda: asyncio.run(create_key(get_settings(), user, tier)))
    except ValueError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from exc
    typer.echo(f"key {principal.key_id} for user {principal.user_id}, tier {principal.tier}:")
    typer.echo(key)


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Option("", "--key-id", help="The id printed when the key was made."),
    user: str = typer.Option("", help="Revoke every key of this user instead."),
) -> None:
    """Revoke a key, or all of a user's keys; roles refuse them within a minute."""
    from tandoor.policies.api_keys import revoke_keys

    if bool(key_id) == bool(user):
        typer.secho("error: give --key-id or --user (one of them)", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    settings = get_settings()
    now, before = _stack_guard(
        lambda: asyncio.run(revoke_keys(settings, key_id or None, user or None))
    )
    if not now and not before:
        named = f"key id {key_id!r}" if key_id else f"user {user!r}"
        typer.secho(f"error: no key with {named}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1)
    typer.echo(f"revoked {len(now)} key(s): {', '.join(now) or '-'}")
    if before:  # a second run says so, not "revoked" again
        typer.echo(f"already revoked: {', '.join(before)}")


@app.command("prepare-model")
def prepare_model(name: str = typer.Argument("smollm2", help="A model in TANDOOR_MODELS.")) -> None:
    """Make a model's Hugging Face folder ready (converts the bundled one once)."""
    from workers.model_store import resolve_model_dir

    try:
        folder = resolve_model_dir(name, get_settings())
    # Not a model of the settings, not a model folder, or its package not installed.
    except (ValueError, FileNotFoundError) as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from exc
    typer.echo(f"{name}: {folder}")


@app.command("cancel")
def cancel(
    request_id: str, reason: str = typer.Option("", help="Kept in the control event.")
) -> None:
    """Cancel a request, whether it is generating, queued, or not yet taken."""
    from producers.control import cancel_request

    _stack_guard(lambda: asyncio.run(cancel_request(get_settings(), request_id, reason or None)))
    typer.echo(f"cancel sent for {request_id}")


def local_tier(settings: Settings) -> str:
    """The tier of the key the main job prints: plus, else the first interactive one (a
    key of the batch band is refused on the chat page). With TANDOOR_TIERS lacking
    plus, the job started everything, then failed with a traceback."""
    interactive = [name for name, policy in settings.tiers.items() if policy.band != BATCH_BAND]
    if not interactive:
        raise InfraError("TANDOOR_TIERS has no interactive tier: the chat page's key needs one")
    return "plus" if "plus" in interactive else interactive[0]


def _bootstrap() -> None:
    from infra.stack import bootstrap

    report = _guard(lambda: _stack_guard(lambda: asyncio.run(bootstrap(get_settings()))))
    typer.echo(f"bootstrap: {report.describe()}")


def _print_status(stack: Stack) -> bool:
    statuses = stack.status()
    for status in statuses:
        typer.echo(status.describe())
    healthy = all(status.ready for status in statuses)
    typer.echo("stack healthy" if healthy else "stack NOT healthy")
    return healthy


def _guard(action: Callable[[], T]) -> T:
    try:
        return action()
    except InfraError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from exc


def _stack_guard(action: Callable[[], T]) -> T:
    """A command that needs Kafka, Cassandra or Redis: one line when they are not
    there, not a traceback of a hundred (`tandoor ask` is README's first command)."""
    from aiokafka.errors import KafkaError

    from tandoor.clients import CASSANDRA_DOWN, REDIS_DOWN

    try:
        return action()
    except (KafkaError, *CASSANDRA_DOWN, *REDIS_DOWN) as exc:
        typer.secho(
            f"error: {type(exc).__name__}: {exc}; is the stack up? (scripts/run.sh, or "
            "`tandoor infra up` for the servers alone)",
            err=True,
            fg=typer.colors.RED,
        )
        raise typer.Exit(2) from exc
    except TimeoutError as exc:
        typer.secho(
            "error: nothing came back in time; is a worker running for this model?",
            err=True,
            fg=typer.colors.RED,
        )
        raise typer.Exit(2) from exc


def main() -> None:
    app()
