"""LLM: the offline batch API, ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Union

from tqdm import tqdm

from kvferry.config import ConfigError
from kvferry.engine.arg_utils import EngineArgs
from kvferry.engine.llm_engine import LLMEngine
from kvferry.outputs import RequestOutput
from kvferry.sampling_params import SamplingParams
from kvferry.tokenizer import Tokenizer

PromptType = Union[str, list[int], dict[str, Any]]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


class LLM:
    """The offline engine. ``shutdown()`` (or ``with LLM(...) as llm:``) stops it: the KV
    event publisher, the connector, the workers."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **kwargs))
        scheduler = self.engine.scheduler
        if scheduler.kv_event_publisher is not None:
            # A publisher holds a socket and a thread: without shutdown() they still close
            # when this LLM is collected or the interpreter exits.
            weakref.finalize(self, scheduler.close_kv_event_publisher)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        items = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ConfigError(
                    f"got {len(params)} SamplingParams for {len(items)} prompts; pass one or one each"
                )
        ids = []
        try:
            for prompt, sp in zip(items, params, strict=True):
                ids.append(self.engine.add_request(prompt, sp))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            if pending:
                self.engine.abort_request(sorted(pending))
        return [finished[i] for i in ids]
