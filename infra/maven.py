"""Fetch a server's runtime class path from Maven Central, once per pom version."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
from pathlib import Path

from infra.errors import FetchError

COPY_DEPENDENCIES = "org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy-dependencies"


def fetch_classpath(pom: Path, cache_dir: Path) -> Path:
    """The folder of jars for `pom`, downloading them only when this pom is new. One
    fetch at a time per pom (the cache is shared by every checkout on the machine: two
    at once removed each other's partial folder), and Maven told to refuse a jar whose
    checksum does not match (its default only warns, and a bad jar stayed cached)."""
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:12]
    dest = cache_dir / f"{pom.parent.name}-{digest}"
    if (dest / ".complete").exists():
        return dest
    if shutil.which("mvn") is None:
        raise FetchError("Maven (mvn) is not installed; it fetches the servers' jars")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / f"{dest.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (dest / ".complete").exists():  # not fetched meanwhile by the holder
            _fetch_into(pom, dest)
    return dest


def _fetch_into(pom: Path, dest: Path) -> None:
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    argv = [
        "mvn",
        "-q",
        "-B",
        "--strict-checksums",
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
