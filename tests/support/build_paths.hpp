#pragma once
// Where the tests find the repository and the executables they start. CMake sets them on
// one source file (build_paths.cpp) only: a path in the compile flags of every test source
// would differ between clones, and ccache could reuse none of their objects.
namespace troupe::test {

extern const char* const source_dir;      ///< the repository
extern const char* const troupe_binary;   ///< build/troupe
extern const char* const ipc_peer;        ///< build/troupe_ipc_peer
extern const char* const transport_peer;  ///< build/troupe_transport_peer ("" when built without gloo)

}  // namespace troupe::test
