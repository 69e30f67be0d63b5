"""`tandoor batch submit|collect`: batch jobs from the command line, with progress, as a
client of the gateway's Batches API (TANDOOR_API_URL, default the local gateway)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import typer

from producers.batch import BatchClient, BatchError, Progress, api_url_from_env
from tandoor.settings import get_settings

T = TypeVar("T")

batch_app = typer.Typer(no_args_is_help=True, help="Batch jobs: JSONL prompts in, JSONL out.")
API_KEY = typer.Option(..., envvar="TANDOOR_API_KEY", help="Your key; its quota is charged.")
IN_FILE = typer.Argument(..., exists=True, dir_okay=False, help="One prompt per line.")
OUT_FILE = typer.Argument(..., dir_okay=False, help="Results, one per input line.")


@batch_app.command("submit")
def submit(
    file: Path = IN_FILE,
    model: str = typer.Option(..., help="A served model (TANDOOR_MODELS)."),
    api_key: str = API_KEY,
) -> None:
    """Upload the file and create a batch of it (every line is checked first). Prints
    the batch id as the last line."""
    batch_id = _run(api_key, "submitting", lambda c, p: c.submit(file, model, p))
    typer.echo(batch_id)


@batch_app.command("collect")
def collect(
    batch_id: str,
    out: Path = OUT_FILE,
    wait: float = typer.Option(
        600, help="Give up once no line has been answered for this many seconds."
    ),
    api_key: str = API_KEY,
) -> None:
    """Write results in input order, with usage, and an error for each failed line.
    Exits 3 unless every line has its reply."""
    if not out.resolve().parent.is_dir():  # told now, not after the whole wait
        typer.secho(f"error: no folder {out.resolve().parent} to write {out.name} in", err=True)
        raise typer.Exit(2)
    done = _run(api_key, "answered", lambda c, p: c.collect(batch_id, out, wait, p))
    typer.echo(
        f"{out}: {done.answered} of {done.lines} lines answered, {done.failed} failed "
        f"(batch {done.status})"
    )
    if not done.complete:
        raise typer.Exit(3)


def _run(
    api_key: str,
    label: str,
    work: Callable[[BatchClient, Progress], Coroutine[Any, Any, T]],
) -> T:
    settings = get_settings()
    api_url = api_url_from_env(settings.host, settings.gateway_port)

    async def main() -> T:
        async with BatchClient(api_url, api_key) as client:
            # On stderr: stdout is the batch id alone (`ID=$(tandoor batch submit ...)`).
            with typer.progressbar(length=1, label=label, file=sys.stderr) as bar:

                def progress(done: int, total: int) -> None:
                    bar.length = total
                    bar.update(done - bar.pos)

                return await work(client, progress)

    try:
        return asyncio.run(main())
    except (BatchError, httpx.HTTPError, OSError) as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from exc
