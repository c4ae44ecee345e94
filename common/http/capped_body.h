// Reading an HTTP request body with a size cap, whatever its transfer encoding.
//
// Why: cpp-httplib 0.11.4 applies Server::set_payload_max_length only to bodies with a
// Content-Length; a chunked body (or one read to the end of the connection) is appended to
// Request::body without limit, so one request can make the process buffer gigabytes. Routes that
// take a body are registered with the ContentReader overload (Server::Post(pattern,
// HandlerWithContentReader)) and read it with ReadCappedBody, which stops reading at the cap.
#ifndef SHARDSERVE_COMMON_HTTP_CAPPED_BODY_H_
#define SHARDSERVE_COMMON_HTTP_CAPPED_BODY_H_

#include <cstddef>
#include <functional>
#include <string>

namespace httplib {
class ContentReader;
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace shardserve {

enum class BodyRead {
  kOk,        // *body holds the whole body (at most `max_bytes`)
  kTooLarge,  // the body is over `max_bytes`: reading stopped there (answer 413, then close)
  kBroken,    // malformed framing or the client went away (answer 400, then close)
};

// Reads the request's body through `reader` into *body, keeping at most `max_bytes`. Call once per
// request, from its handler; `res` is the request's response (cpp-httplib marks it 413 when a
// Content-Length over the server's payload_max_length refused the body before it was read).
BodyRead ReadCappedBody(const httplib::ContentReader& reader, size_t max_bytes, const httplib::Response& res,
                        std::string* body);

// Makes `res` close the connection once it is written, with `content` (of `content_type`) as its
// body: after a body that was not read to its end, the rest of it must not be parsed as the next
// request. (cpp-httplib keeps a connection open unless the *request* asked to close it; a reply
// whose content provider reports failure after writing everything ends the connection.)
void ReplyAndClose(httplib::Response& res, int status, std::string content, const char* content_type);

// Registers, after every other route of `server`, POST/PUT/PATCH handlers for any path that answer
// without reading the body (cpp-httplib reads the body of a request no content-reader route takes
// into Request::body, chunked ones without limit) and close the connection. `reply` fills the
// response (status and content, e.g. a 404 naming the route). Call after the server's routes.
void RefuseUnroutedBodies(httplib::Server& server,
                          std::function<void(const httplib::Request&, httplib::Response&)> reply);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_HTTP_CAPPED_BODY_H_
