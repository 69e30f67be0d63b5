"""The layout holds: roles below the gateway never import it, role processes never load
the local-server tooling, every third-party import is declared in pyproject.toml, and
facts shared across languages agree."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from producers.gateway.chat.watch import KEEPALIVE_S
from producers.gateway.conversations.protocol import AUTO_TITLE_CHARS
from tandoor import PROJECT_ROOT

PACKAGES = ["tandoor", "producers", "streams", "workers", "consumers", "schemas", "infra"]
BELOW_THE_GATEWAY = ["consumers", "streams", "workers", "schemas", "tandoor/policies"]


def imported_modules(folder: str) -> Iterator[tuple[Path, str]]:
    """(file, module) for every absolute import in the folder's Python files."""
    for path in sorted((PROJECT_ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                yield from ((path, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield path, node.module


@pytest.mark.parametrize("folder", BELOW_THE_GATEWAY)
def test_roles_below_the_gateway_do_not_import_it(folder: str) -> None:
    upward = [
        f"{path.relative_to(PROJECT_ROOT)}: {module}"
        for path, module in imported_modules(folder)
        if module.split(".")[0] == "producers"
    ]
    assert not upward, "shared policies belong in tandoor/policies: " + ", ".join(upward)


def test_role_processes_do_not_load_the_local_server_tooling() -> None:
    roles = "tandoor.cli, workers.worker, consumers.persist, streams.app, producers.gateway.app"
    probe = f"import sys, {roles}; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=PROJECT_ROOT
    ).stdout.split()
    tooling = [m for m in loaded if m.startswith(("infra.stack", "infra.roles", "infra.process"))]
    assert not tooling, tooling


def declared_distributions() -> set[str]:
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {normalized(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in requirements}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("folder", [*PACKAGES, "tests", "bench"])
def test_every_third_party_import_is_declared(folder: str) -> None:
    local = {*PACKAGES, "tests", "bench"}
    providers = importlib.metadata.packages_distributions()
    declared = declared_distributions()
    missing = set()
    for path, module in imported_modules(folder):
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top in local or top == "__future__":
            continue
        distributions = {normalized(d) for d in providers.get(top, [top])}
        if not distributions & declared:
            missing.add(f"{top} ({', '.join(sorted(distributions))}) in {path.name}")
    assert not missing, f"imported but not in pyproject.toml: {sorted(missing)}"


def test_the_chat_page_makes_provisional_titles_as_the_gateway_does() -> None:
    app_js = (PROJECT_ROOT / "producers/gateway/web/app.js").read_text()
    found = re.search(r"const AUTO_TITLE_CHARS = (\d+);", app_js)
    assert found and int(found[1]) == AUTO_TITLE_CHARS


def test_the_chat_page_waits_for_several_keep_alives_before_giving_a_stream_up() -> None:
    sse_js = (PROJECT_ROOT / "producers/gateway/web/sse.js").read_text()
    found = re.search(r"export const STALLED_MS = (\d+);", sse_js)
    assert found and int(found[1]) >= 3 * KEEPALIVE_S * 1000


def test_the_documentation_names_no_file_outside_the_project() -> None:
    """The project carries its own documentation: no page or comment sends a reader to
    the founders' notes, which a clone does not have."""
    listed = ["git", "ls-files", "README.md", "docs", "*.py", "*.js", "*.sh", "*.yaml"]
    tracked = subprocess.run(listed, cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    pointing = re.compile(r"DESIGN\.md|ENVIRONMENT\.md|STYLE\.md|\.\./shared")
    named = [n for n in tracked.stdout.split() if pointing.search((PROJECT_ROOT / n).read_text())]
    assert not named, f"pointing outside the project: {named}"


def test_the_readme_stays_a_front_door_and_its_links_resolve() -> None:
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
