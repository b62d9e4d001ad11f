// Errors of the native I/O layer.
//
// The lowest layer (engines, file helpers) returns -errno and never throws.
// The API layer (Handle, Future) turns a failure into one IoError that carries
// errno, path, byte offset and the operation; the pybind11 edge converts it
// into a Python OSError exactly once (see bindings.cpp).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace infinity::io {

struct ErrorInfo {
  int err = 0;             // errno value, 0 when no error happened
  std::string path;        // file the request touched
  int64_t offset = -1;     // file offset where the failure was seen
  std::string what;        // short human text, e.g. "read past end of file"
};

class IoError : public std::runtime_error {
 public:
  explicit IoError(ErrorInfo info);
  const ErrorInfo& info() const { return info_; }

 private:
  ErrorInfo info_;
};

// Bad arguments: becomes ValueError in Python.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

std::string format_error(const ErrorInfo& info);

}  // namespace infinity::io
