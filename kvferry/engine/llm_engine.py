"""LLMEngine: one step is schedule -> execute -> update.

scheduler_output = scheduler.schedule()
runner_output    = executor.execute_model(scheduler_output)
core_outputs     = scheduler.update_from_output(scheduler_output, runner_output)
user_outputs     = output_processor.process(core_outputs)
"""

from __future__ import annotations

import itertools
import time
from typing import Any, TypeGuard

from kvferry import envs
from kvferry.config import ConfigError, EngineConfig
from kvferry.core.block_hash import get_request_block_hasher
from kvferry.core.outputs import EngineCoreOutput
from kvferry.core.scheduler import Scheduler
from kvferry.engine.arg_utils import EngineArgs
from kvferry.engine.output_processor import OutputProcessor
from kvferry.engine.prompt_checks import check_prompt_ids, check_stop_token_ids
from kvferry.kv_layout import record_engine_layout
from kvferry.kv_transfer.base import KVConnectorRole, KVConnectorStats, KVConnectorStatsTotals
from kvferry.kv_transfer.factory import KVConnectorFactory
from kvferry.kv_transfer.trace import maybe_wrap
from kvferry.logger import fmt_fields, init_logger
from kvferry.outputs import RequestOutput
from kvferry.request import Request, RequestStatus
from kvferry.sampling_params import SamplingParams
from kvferry.tokenizer import Tokenizer
from kvferry.worker.executor import create_executor

logger = init_logger(__name__)


def _merge_finals(outputs: list[RequestOutput], finals: list[EngineCoreOutput]) -> None:
    """Merge what ``finish_requests`` returned for requests the output processor ended into the
    final outputs already built: the connector's kv_transfer_params, and an error if the
    connector's ``request_finished`` failed."""
    by_id = {f.request_id: f for f in finals}
    for out in outputs:
        final = by_id.get(out.request_id)
        if final is None:
            continue
        if final.kv_transfer_params:
            out.kv_transfer_params = final.kv_transfer_params
        if final.finish_reason == "error" and out.error is None:
            out.outputs[0].finish_reason, out.outputs[0].stop_reason = "error", None
            out.error = final.error


def _is_token_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        mc = config.model_config
        assert mc.tokenizer is not None
        self.tokenizer = Tokenizer(mc.tokenizer)
        self.eos_token_ids = tuple(
            dict.fromkeys(self.tokenizer.eos_token_ids + mc.arch.eos_token_ids)
        )
        self.executor = create_executor(config)
        self.kv_cache_config = self.executor.kv_cache_config
        # The scheduler-side connector sees the workers' layout (they may be other processes).
        record_engine_layout(self.kv_cache_config.layout)
        kvt = config.kv_transfer_config
        connector = None
        if kvt is not None:
            connector = maybe_wrap(
                KVConnectorFactory.create_connector(
                    config, KVConnectorRole.SCHEDULER, self.kv_cache_config
                )
            )
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            self.kv_cache_config,
            max_model_len=mc.max_len,
            log_stats=config.log_stats,
            connector=connector,
            kv_load_failure_policy=kvt.kv_load_failure_policy if kvt else "fail",
            kv_events_config=config.kv_events_config,
        )
        if connector is not None:
            # KV connector: what each worker's connector published after register_kv_caches
            # (e.g. its side-channel address), handed to the scheduler side once, keyed by
            # (pp_rank, tp_rank) as vLLM does; kvferry has no pipeline stages (pp_rank 0).
            handshake = self.executor.get_kv_connector_handshake_metadata()
            if handshake:
                connector.set_xfer_handshake_metadata_pp_aware(
                    {(0, rank): meta for rank, meta in handshake.items()}
                )
        # Connector stats: totals since start (in request metrics), totals of the current log
        # interval, and the raw stats of the last step (for exporters such as Prometheus).
        self.kv_connector_totals = KVConnectorStatsTotals()
        self._interval_kv_stats = KVConnectorStatsTotals()
        self.last_step_kv_connector_stats: KVConnectorStats | None = None
        self.last_step_num_scheduled_tokens = 0  # for the iteration-tokens metric
        self._block_hasher = get_request_block_hasher(
            config.cache_config.block_size, config.cache_config.prefix_caching_hash_algo
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._last_log = time.monotonic()
        self._tokens_since_log = 0
        self.startup_seconds = time.perf_counter() - t0
        logger.info(fmt_fields("engine ready", seconds=self.startup_seconds))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def _tokenize(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; a dict with ``prompt_token_ids`` is not tokenized
        again (the server tokenizes in its own threads and hands over the ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
                if not _is_token_list(ids):
                    raise ConfigError("prompt_token_ids must be a list of integers")
                if text is not None and not isinstance(text, str):
                    raise ConfigError("a prompt dict's 'prompt' must be a string")
                return text, list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ConfigError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(
                    f"the prompt is not valid Unicode text: a lone UTF-16 surrogate at {e.start}"
                ) from None
            return prompt, self.tokenizer.encode(prompt)
        if _is_token_list(prompt):
            return None, list(prompt)
        raise ConfigError(f"unsupported prompt type {type(prompt).__name__}")

    def add_request(
        self,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and enqueue one request; raises ConfigError on bad input. ``max_tokens``
        beyond what the prompt leaves of ``max_model_len`` is not an error here (the request
        stops at the context's end, finish reason ``length``, as in vLLM's offline LLM); the
        server refuses it instead."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"expected SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        mc = self.config.model_config
        check_stop_token_ids(params, mc.arch.vocab_size)
        check_prompt_ids(ids, mc.max_len, mc.arch.vocab_size)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.scheduler.get_request(request_id) is not None:
            raise ConfigError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id,
            ids,
            params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            block_hasher=self._block_hasher,
        )
        connector = self.scheduler.connector
        if connector is not None and request.kv_transfer_params is not None:
            try:
                connector.validate_kv_transfer_params(request.kv_transfer_params)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.output_processor.add_request(request_id, text, ids, params)
        self.scheduler.add_request(request)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        """True while a step still has work: requests to run, finished ids to flush to the
        workers, or blocks a KV connector holds for finished requests."""
        return self.scheduler.has_requests()

    def step(self) -> list[RequestOutput]:
        """One schedule -> execute -> update round; returns the outputs of requests that
        progressed or finished.

        A fault of one request (a connector hook that raised for it, sampling or detokenizing
        that failed for it) ends only that request: finish reason ``error``, with
        ``RequestOutput.error`` saying why. An exception raised from here is a fault of the
        step as a whole (e.g. the forward). It is not narrowed down by re-running the step
        without a suspect request: ``schedule()`` has already advanced every request and
        handed blocks and plans to the connector and the workers, and the forward may have
        written part of the KV or started transfers. The connector protocol cannot undo any
        of that, so a re-run would start from half-applied state. What a failed step leaves
        is only made safe: its blocks leave the prefix cache (``Scheduler.discard_step``), and
        the caller aborts its requests.
        """
        scheduler_output = self.scheduler.schedule()
        self.last_step_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        try:
            runner_output = self.executor.execute_model(scheduler_output)
            core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        except BaseException:
            self.scheduler.discard_step(scheduler_output)
            raise
        self._collect_kv_connector_stats()
        processed = self.output_processor.process(core_outputs)
        finals: list[EngineCoreOutput] = []
        if processed.stopped_by_string:
            finals += self.scheduler.finish_requests(
                processed.stopped_by_string, RequestStatus.FINISHED_STOPPED
            )
        for request_id, error in processed.failed.items():
            finals += self.scheduler.finish_requests(
                request_id, RequestStatus.FINISHED_ERROR, error
            )
        if finals:
            _merge_finals(processed.outputs, finals)
        for out in processed.outputs:
            if out.finished and out.metrics is not None and not self.kv_connector_totals.is_empty():
                out.metrics.kv_connector = self.kv_connector_totals.as_dict()
        if self.config.log_stats:
            self._maybe_log(sum(len(o.new_token_ids) for o in core_outputs))
        return processed.outputs

    def _collect_kv_connector_stats(self) -> None:
        stats = self.scheduler.take_kv_connector_stats()
        if stats is not None and stats.is_empty():
            stats = None
        self.last_step_kv_connector_stats = stats
        if stats is not None:
            self.kv_connector_totals.add(stats)
            self._interval_kv_stats.add(stats)

    def _maybe_log(self, new_tokens: int) -> None:
        self._tokens_since_log += new_tokens
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < envs.log_stats_interval_s():
            return
        fields = dict(vars(self.scheduler.make_stats() or {}))
        fields.update({f"kv_{k}": v for k, v in self._interval_kv_stats.as_dict().items()})
        logger.info(
            fmt_fields("engine stats", gen_tok_per_s=self._tokens_since_log / elapsed, **fields)
        )
        self._interval_kv_stats.reset()
        self._last_log, self._tokens_since_log = now, 0

    def shutdown(self) -> None:
        """Stop the scheduler (its KV event publisher, the connector) and the workers; only
        the first call does anything."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        self.scheduler.shutdown()
        self.executor.shutdown()
