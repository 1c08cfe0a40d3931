#pragma once
// The SentencePiece plugin's interface (compute/data/spm_plugin.cpp, built as the module
// libtroupe_spm.so beside the executables).
//
// Why a plugin: Debian's libsentencepiece carries its own copy of protobuf-lite and
// exports its symbols; LibTorch loads the full libprotobuf. Linked into one program, the
// dynamic linker binds libprotobuf's start-up code to libsentencepiece's copies and the
// program crashes before main. compute/data/tokenizer.cpp therefore loads the plugin with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND), after LibTorch: SentencePiece then binds to its own
// copy and nothing else sees it.
#include <cstddef>
#include <string>
#include <vector>

extern "C" {

/// What the plugin does. Every call that can fail returns false and sets `error`.
struct troupe_spm_api {
  void* (*load)(const std::string& model, std::string& error);
  void (*release)(void* processor);
  int (*size)(void* processor);
  bool (*encode)(void* processor, const std::string& text, std::vector<int>& ids, std::string& error);
  bool (*decode)(void* processor, const std::vector<int>& ids, std::string& text, std::string& error);
  /// 0: a normal piece, 1: control, 2: byte, 3: unknown or unused.
  int (*kind)(void* processor, int id);
  const std::string* (*piece)(void* processor, int id);
  /// Trains with `options` (key=value pairs) on `lines`; the model's bytes into `model`.
  bool (*train)(const std::vector<std::pair<std::string, std::string>>& options, const std::vector<std::string>& lines,
                std::string& model, std::string& error);
};

/// The plugin's one entry point (dlsym name "troupe_spm").
const troupe_spm_api* troupe_spm();
}
