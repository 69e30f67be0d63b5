"""Fetch a server's runtime class path from Maven Central, once per pom version."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from infra.errors import FetchError

COPY_DEPENDENCIES = "org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy-dependencies"


def fetch_classpath(pom: Path, cache_dir: Path) -> Path:
    """The folder of jars for `pom`, downloading them only when this pom is new."""
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:12]
    dest = cache_dir / f"{pom.parent.name}-{digest}"
    if (dest / ".complete").exists():
        return dest
    if shutil.which("mvn") is None:
        raise FetchError("Maven (mvn) is not installed; it fetches the servers' jars")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    argv = [
        "mvn",
        "-q",
        "-B",
        "-f",
        str(pom),
        COPY_DEPENDENCIES,
        "-DincludeScope=runtime",
        f"-DoutputDirectory={partial}",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise FetchError(f"fetching {pom} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    (partial / ".complete").touch()
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    return dest
