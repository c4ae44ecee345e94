// Raw-bytes request handling at gRPC service edges. gRPC 1.51's typed callback handlers answer a
// request that does not parse as its message with UNIMPLEMENTED (as if the method did not exist);
// services register raw (ByteBuffer) methods instead and parse here, so that malformed bytes get
// INVALID_ARGUMENT naming the message type.
//
//   grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
//                                      grpc::ByteBuffer* out) override {
//     return RawUnary<v1::TokenizeRequest, v1::TokenizeResponse>(ctx, in, out, [&](const auto& req, auto* resp) {
//       return DoTokenize(ctx, req, resp);   // -> grpc::Status
//     });
//   }
//
// Thread-safe, pure (besides finishing the call's reactor).
#ifndef SHARDSERVE_COMMON_STATUS_GRPC_RAW_H_
#define SHARDSERVE_COMMON_STATUS_GRPC_RAW_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>

#include <string>
#include <vector>

namespace shardserve {

// Parses `in` into `out`; INVALID_ARGUMENT naming the message type when the bytes are not one.
template <class Message>
grpc::Status ParseRawRequest(const grpc::ByteBuffer& in, Message* out) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (in.Valid()) {
    if (!in.Dump(&slices).ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "unreadable request");
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  if (!out->ParseFromString(bytes)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the request is not a valid " + std::string(out->GetTypeName()) + " message");
  }
  return grpc::Status::OK;
}

// Serializes `message` into `out`.
template <class Message>
void SerializeRawMessage(const Message& message, grpc::ByteBuffer* out) {
  grpc::Slice slice(message.SerializeAsString());
  *out = grpc::ByteBuffer(&slice, 1);
}

// A unary call over raw bytes: parses the request, runs fn(const Request&, Response*) ->
// grpc::Status synchronously, serializes the response when OK, and finishes the call.
template <class Request, class Response, class Fn>
grpc::ServerUnaryReactor* RawUnary(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                   grpc::ByteBuffer* out, Fn&& fn) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  Request request;
  Response response;
  grpc::Status st = ParseRawRequest(*in, &request);
  if (st.ok()) st = fn(request, &response);
  if (st.ok()) SerializeRawMessage(response, out);
  reactor->Finish(st);
  return reactor;
}

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_STATUS_GRPC_RAW_H_
