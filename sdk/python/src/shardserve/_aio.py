"""The asyncio client (grpc.aio)."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, List, Mapping, Optional, Sequence, Union

import grpc
import grpc.aio

from shardserve import _common
from shardserve._types import ClusterStatus, GenerateDelta, GenerateResult, ModelInfo, RetryOptions, TlsOptions
from shardserve.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc


class AsyncGenerateStream:
    """A generation being streamed: `async for delta in stream`, or `await stream.result()` for the
    whole answer. Errors raise ShardserveError; cancel() ends the request. A stream that breaks
    with UNAVAILABLE after tokens arrived is resumed (RetryOptions), as Client's is."""

    def __init__(self, start: Callable[[inference_pb2.GenerateRequest, float], grpc.aio.UnaryStreamCall],
                 resume: _common.Resume) -> None:
        self._start = start
        self._resume = resume
        self._call = start(resume.request(), resume.timeout_left())
        self._it = self._call.__aiter__()
        self._acc = _common.Choices()
        self._done = False
        self._cancelled_by_caller = False

    def __aiter__(self) -> AsyncIterator[GenerateDelta]:
        return self

    async def __anext__(self) -> GenerateDelta:
        while not self._done:
            try:
                resp = await self._it.__anext__()
            except StopAsyncIteration:
                self._done = True
                raise
            except grpc.RpcError as e:
                wait = self._resume.backoff(e)
                if wait is None or self._cancelled_by_caller:
                    self._done = True
                    raise _common.error(e) from None
                await asyncio.sleep(wait)
                if self._cancelled_by_caller:
                    break
                self._call = self._start(self._resume.request(), self._resume.timeout_left())
                self._it = self._call.__aiter__()
                continue
            except asyncio.CancelledError:
                # cancel() ends the call's iterator with CancelledError; a cancelled task must stay one.
                if not self._cancelled_by_caller:
                    raise
                break
            self._resume.seen(resp)
            d = _common.delta(resp)
            self._acc.add(d)
            return d
        if self._cancelled_by_caller:
            self._done = True
            raise _common.ShardserveError(grpc.StatusCode.CANCELLED, "the generation was cancelled") from None
        raise StopAsyncIteration

    async def result(self) -> GenerateResult:
        async for _ in self:
            pass
        return self._acc.result()

    async def results(self) -> List[GenerateResult]:
        """Reads what is left and returns each choice's whole answer, in choice order (generate's n)."""
        async for _ in self:
            pass
        return self._acc.results()

    def cancel(self) -> None:
        """Ends the request; the next read raises ShardserveError with CANCELLED."""
        self._cancelled_by_caller = True
        self._call.cancel()


class AsyncClient:
    """The asyncio counterpart of Client, with the same options; create it inside a running event
    loop and close it with `await client.close()` (or `async with`)."""

    def __init__(self, address: str, *, timeout: float = 600.0, tls: Union[TlsOptions, bool, None] = None,
                 bearer_token: Optional[str] = None, retry: RetryOptions = RetryOptions()) -> None:
        self._settings = _common.Settings(address, timeout, tls, bearer_token, retry)
        creds = self._settings.credentials()
        opts = self._settings.channel_options
        self._channel = (grpc.aio.secure_channel(address, creds, options=opts) if creds is not None
                         else grpc.aio.insecure_channel(address, options=opts))
        self._inference = inference_pb2_grpc.InferenceStub(self._channel)
        self._admin = control_pb2_grpc.AdminStub(self._channel)

    def generate(self, prompt: _common.Prompt, *, max_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, request_id: str = "", min_p: float = 0.0,
                 logit_bias: Optional[Mapping[int, float]] = None, min_tokens: int = 0, logprobs: bool = False,
                 top_logprobs: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, prompt_logprobs: bool = False, stop: Sequence[str] = (),
                 json_schema=None, json_object: bool = False, regex: Optional[str] = None, n: int = 1,
                 tools: Optional[Sequence[Mapping]] = None, tool_choice=None, parallel_tool_calls: bool = True,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 continue_final_message: bool = False, truncate_prompt_tokens: Optional[int] = None,
                 priority: int = 0, allowed_token_ids: Sequence[int] = (), bad_words: Sequence[str] = (),
                 chat_template_kwargs: Optional[Mapping] = None,
                 timeout: Optional[float] = None) -> AsyncGenerateStream:
        """Starts a generation; see Client.generate."""
        req = _common.generate_request(prompt, max_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                       ignore_eos, request_id, min_p, logit_bias, min_tokens, logprobs, top_logprobs,
                                       presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                       repetition_penalty=repetition_penalty, prompt_logprobs=prompt_logprobs,
                                       stop=stop, json_schema=json_schema, json_object=json_object, regex=regex,
                                       n=n, tools=tools, tool_choice=tool_choice,
                                       parallel_tool_calls=parallel_tool_calls,
                                       include_stop_str_in_output=include_stop_str_in_output,
                                       skip_special_tokens=skip_special_tokens,
                                       continue_final_message=continue_final_message,
                                       truncate_prompt_tokens=truncate_prompt_tokens, priority=priority,
                                       allowed_token_ids=allowed_token_ids, bad_words=bad_words,
                                       chat_template_kwargs=chat_template_kwargs)
        resume = _common.Resume(req, self._settings.retry, self._settings.call_timeout(timeout))
        return AsyncGenerateStream(
            lambda r, left: self._inference.Generate(r, timeout=left, metadata=self._settings.metadata), resume)

    async def tokenize(self, text: str, *, add_special_tokens: bool = False,
                       timeout: Optional[float] = None) -> List[int]:
        req = inference_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._unary(self._inference.Tokenize, req, timeout)).ids)

    async def model_info(self, *, timeout: Optional[float] = None) -> ModelInfo:
        return _common.model_info(await self._unary(self._inference.GetModelInfo,
                                                    inference_pb2.GetModelInfoRequest(), timeout))

    async def cluster_status(self, *, timeout: Optional[float] = None) -> ClusterStatus:
        return _common.cluster_status(await self._unary(self._admin.GetClusterStatus,
                                                        control_pb2.GetClusterStatusRequest(), timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, method, request, timeout: Optional[float]):  # type: ignore[no-untyped-def]
        try:
            return await method(request, timeout=self._settings.call_timeout(timeout),
                                metadata=self._settings.metadata)
        except grpc.RpcError as e:
            raise _common.error(e) from None
