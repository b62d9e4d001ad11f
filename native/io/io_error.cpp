#include "io_error.hpp"

#include <cstring>

namespace infinity::io {

std::string format_error(const ErrorInfo& info) {
  std::string msg = info.what.empty() ? std::string(std::strerror(info.err)) : info.what;
  msg += " (errno " + std::to_string(info.err) + " " + std::strerror(info.err) + ")";
  msg += ", path " + info.path + ", offset " + std::to_string(info.offset);
  return msg;
}

IoError::IoError(ErrorInfo info) : std::runtime_error(format_error(info)), info_(std::move(info)) {}

}  // namespace infinity::io
