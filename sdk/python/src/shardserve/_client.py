"""The synchronous client."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence, Union

import grpc

from shardserve import _common
from shardserve._types import (ClusterStatus, GenerateDelta, GenerateResult, ModelInfo, RetryOptions,
                               ShardserveError, TlsOptions)
from shardserve.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc


class GenerateStream:
    """A generation being streamed. Iterate over it for the deltas; result() reads what is left and
    returns the whole answer (with the finish reason and usage). Errors raise ShardserveError.
    A stream that breaks with UNAVAILABLE after tokens arrived is resumed (RetryOptions): the deltas
    go on as if it had not broken. cancel() may be called from any thread."""

    def __init__(self, start: Callable[[inference_pb2.GenerateRequest, float], Any],
                 resume: _common.Resume) -> None:
        self._start = start
        self._resume = resume
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._call = start(resume.request(), resume.timeout_left())
        self._acc = _common.Choices()
        self._done = False

    def __iter__(self) -> Iterator[GenerateDelta]:
        return self

    def __next__(self) -> GenerateDelta:
        while not self._done:
            try:
                resp = next(self._call)  # type: ignore[call-overload]
            except StopIteration:
                self._done = True
                raise
            except grpc.RpcError as e:
                wait = self._resume.backoff(e)
                if wait is None or self._cancelled.is_set():
                    self._done = True
                    raise _common.error(e) from None
                if self._cancelled.wait(wait):
                    self._done = True
                    raise ShardserveError(grpc.StatusCode.CANCELLED, "the generation was cancelled") from None
                with self._lock:
                    self._call = self._start(self._resume.request(), self._resume.timeout_left())
                    if self._cancelled.is_set():  # cancel() came while the call started
                        self._call.cancel()
                continue
            self._resume.seen(resp)
            d = _common.delta(resp)
            self._acc.add(d)
            return d
        raise StopIteration

    def result(self) -> GenerateResult:
        for _ in self:
            pass
        return self._acc.result()

    def results(self) -> List[GenerateResult]:
        """Reads what is left and returns each choice's whole answer, in choice order (generate's n)."""
        for _ in self:
            pass
        return self._acc.results()

    def cancel(self) -> None:
        """Ends the request; the next read raises ShardserveError with CANCELLED."""
        self._cancelled.set()
        with self._lock:
            self._call.cancel()

    def __enter__(self) -> "GenerateStream":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.cancel()


class Client:
    """A synchronous client of a shardserve cluster's coordinator at `address` (HOST:PORT).

    timeout: the deadline of each call in seconds (a generation's whole stream included); each call
    may give its own. tls: True for TLS with the system's roots, or TlsOptions. bearer_token: sent as
    "authorization: Bearer <token>". retry: retries of UNAVAILABLE before anything was received,
    and resumes of a generation whose stream broke after tokens arrived (RetryOptions).
    Raises ValueError for bad options; calls raise ShardserveError. Thread-safe; close() (or a with
    block) releases the channel."""

    def __init__(self, address: str, *, timeout: float = 600.0, tls: Union[TlsOptions, bool, None] = None,
                 bearer_token: Optional[str] = None, retry: RetryOptions = RetryOptions()) -> None:
        self._settings = _common.Settings(address, timeout, tls, bearer_token, retry)
        creds = self._settings.credentials()
        opts = self._settings.channel_options
        self._channel = (grpc.secure_channel(address, creds, options=opts) if creds is not None
                         else grpc.insecure_channel(address, options=opts))
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
                 timeout: Optional[float] = None) -> GenerateStream:
        """Starts a generation from text (tokenized by the server), token ids (used as given), or chat
        messages ([{"role": "user", "content": "Hi"}], rendered with the model's chat template by the
        server; chat_template_kwargs: more variables for the template, e.g. {"enable_thinking": False};
        continue_final_message=True: the model continues the final message instead of starting
        a new turn). `stop`: text that ends the generation (the text stops right before it, or with it
        when include_stop_str_in_output); skip_special_tokens=False spells the model's special tokens
        in it. truncate_prompt_tokens=k keeps a longer prompt's last k tokens (-1: the last ones that
        fit the context beside max_tokens). priority: the scheduling rank on a coordinator started
        with --scheduling_policy=priority (lower values first; must be 0 otherwise).
        allowed_token_ids: every generated token is one of these ids; bad_words: words kept out of the
        output (their spellings alone and after a space are banned). At most one of json_schema (a
        dict or its JSON text), json_object and regex constrains the output (and not with
        allowed_token_ids). n: that many independent choices (1..16, choice i sampled with seed + i);
        each delta names its choice (index), and the stream's results() gives every choice's answer
        (result(): the only one).
        tools, tool_choice ("none", "auto", "required" or {"type": "function", "function": {"name":
        ...}}) and parallel_tool_calls as OpenAI's chat API has them (chat prompts only; messages may
        carry "tool_calls" and "tool_call_id"): the calls the model made come back as the result's
        tool_calls, with finish_reason "tool_calls"."""
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
        return GenerateStream(
            lambda r, left: self._inference.Generate(r, timeout=left, metadata=self._settings.metadata), resume)

    def tokenize(self, text: str, *, add_special_tokens: bool = False, timeout: Optional[float] = None) -> List[int]:
        req = inference_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._unary(self._inference.Tokenize, req, timeout).ids)

    def model_info(self, *, timeout: Optional[float] = None) -> ModelInfo:
        return _common.model_info(self._unary(self._inference.GetModelInfo, inference_pb2.GetModelInfoRequest(),
                                              timeout))

    def cluster_status(self, *, timeout: Optional[float] = None) -> ClusterStatus:
        return _common.cluster_status(self._unary(self._admin.GetClusterStatus, control_pb2.GetClusterStatusRequest(),
                                                  timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method, request, timeout: Optional[float]):  # type: ignore[no-untyped-def]
        try:
            return method(request, timeout=self._settings.call_timeout(timeout), metadata=self._settings.metadata)
        except grpc.RpcError as e:
            raise _common.error(e) from None



