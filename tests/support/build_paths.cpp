#include "build_paths.hpp"

namespace troupe::test {

const char* const source_dir = TROUPE_SOURCE_DIR;
const char* const troupe_binary = TROUPE_BINARY;
const char* const ipc_peer = TROUPE_IPC_PEER;
const char* const transport_peer = TROUPE_TRANSPORT_PEER;

}  // namespace troupe::test
