#pragma once
// The error of a configuration that cannot be used.
#include <stdexcept>

namespace troupe {

/// Bad configuration: the message says which key, which value and where it came from.
struct config_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

}  // namespace troupe
