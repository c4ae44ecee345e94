"""Python client of a shardserve cluster.

    import shardserve
    with shardserve.Client("127.0.0.1:7000") as client:
        for delta in client.generate("Once upon a time", max_tokens=32):
            print(delta.text, end="", flush=True)
        result = client.generate([1, 403, 407], max_tokens=8).result()
        print(result.token_ids, result.finish_reason, result.usage)

AsyncClient is the asyncio version (`async for delta in client.generate(...)`). Errors from the
server or the connection raise ShardserveError with the gRPC code and the server's message.
"""
from shardserve._aio import AsyncClient, AsyncGenerateStream
from shardserve._client import Client, GenerateStream
from shardserve._types import (ClusterStatus, GenerateDelta, GenerateResult, ModelInfo, RetryOptions,
                               ShardserveError, TlsOptions, TokenLogprob, ToolCall, Usage, WorkerStatus)

__all__ = [
    "AsyncClient", "AsyncGenerateStream", "Client", "ClusterStatus", "GenerateDelta", "GenerateResult",
    "GenerateStream", "ModelInfo", "RetryOptions", "ShardserveError", "TlsOptions", "TokenLogprob", "ToolCall", "Usage", "WorkerStatus",
]
