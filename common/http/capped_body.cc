#include "common/http/capped_body.h"

#include <httplib.h>

#include <memory>
#include <utility>

namespace shardserve {

BodyRead ReadCappedBody(const httplib::ContentReader& reader, size_t max_bytes, const httplib::Response& res,
                        std::string* body) {
  body->clear();
  bool too_large = false;
  // Content-Length bodies over the server's payload_max_length never reach the receiver (the read
  // fails at once); chunked ones are cut here, before anything past the cap is kept.
  const bool ok = reader([&](const char* data, size_t n) {
    if (n > max_bytes - body->size()) {
      too_large = true;
      return false;
    }
    body->append(data, n);
    return true;
  });
  if (ok) return BodyRead::kOk;
  return too_large || res.status == 413 ? BodyRead::kTooLarge : BodyRead::kBroken;
}

void ReplyAndClose(httplib::Response& res, int status, std::string content, const char* content_type) {
  res.status = status;
  res.set_header("Connection", "close");
  res.headers.erase("Content-Type");  // set_content_provider adds its own
  res.body.clear();
  auto data = std::make_shared<std::string>(std::move(content));
  res.set_content_provider(data->size(), content_type,
                           [data](size_t offset, size_t length, httplib::DataSink& sink) {
                             sink.write(data->data() + offset, length);
                             // Written in full: report failure so the connection ends here.
                             return offset + length < data->size();
                           });
}

void RefuseUnroutedBodies(httplib::Server& server,
                          std::function<void(const httplib::Request&, httplib::Response&)> reply) {
  auto refuse = [reply = std::move(reply)](const httplib::Request& req, httplib::Response& res,
                                           const httplib::ContentReader& /*unread*/) {
    reply(req, res);
    const std::string type = res.get_header_value("Content-Type");
    ReplyAndClose(res, res.status, std::move(res.body), type.empty() ? "text/plain" : type.c_str());
    res.body.clear();
  };
  server.Post(".*", refuse);
  server.Put(".*", refuse);
  server.Patch(".*", refuse);
}

}  // namespace shardserve
