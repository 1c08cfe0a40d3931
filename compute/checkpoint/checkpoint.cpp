#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/torch_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

namespace troupe {

namespace {

constexpr const char* pair_record = "troupe_save_pair";

}  // namespace

void save_state_dict_pair(const std::string& path, const state_dict& model, const state_dict& optim,
                          std::int64_t step, const std::string& model_record) {
  std::random_device rd;
  char id[40];
  std::snprintf(id, sizeof id, "%08x%08x%08x", rd(), rd(), rd());
  const std::vector<std::pair<std::string, std::string>> mark{
      {pair_record, "step " + std::to_string(step) + "\nid " + id + "\n"}};
  const auto optim_tmp =
      write_temporary(path + ".optim", [&](const byte_sink& sink) { write_state_dict(optim, sink, mark); });
  auto model_records = mark;
  if (!model_record.empty()) model_records.emplace_back(model_record_name, model_record);
  std::string model_tmp;
  try {
    model_tmp = write_temporary(path, [&](const byte_sink& sink) { write_state_dict(model, sink, model_records); });
  } catch (...) {
    ::unlink(optim_tmp.c_str());
    throw;
  }
  try {
    rename_into_place(optim_tmp, path + ".optim");
  } catch (...) {
    ::unlink(model_tmp.c_str());
    throw;
  }
  try {
    rename_into_place(model_tmp, path);
  } catch (const checkpoint_error& e) {
    sync_folder_of(path);
    throw mixed_pair_error(std::string(e.what()) + ", after " + path +
                           ".optim was replaced: the two files are now of different saves (--load refuses them)");
  }
  sync_folder_of(path);
}

pair_mark read_pair_mark(const std::vector<char>& bytes) {
  pair_mark m;
  std::istringstream in(read_torch_record(bytes, pair_record));
  std::string key;
  while (in >> key) {
    if (key == "step" && !(in >> m.step)) return {};
    if (key == "id" && !(in >> m.id)) return {};
  }
  if (m.id.empty()) return {};
  return m;
}

void save_state_dict(const std::string& path, const state_dict& state) {
  write_file_atomically(path, [&](const byte_sink& sink) { write_state_dict(state, sink); });
}

void write_state_dict(const state_dict& state, const byte_sink& sink,
                      const std::vector<std::pair<std::string, std::string>>& records) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& [name, t] : state) dict.insert(name, t.detach().contiguous());
  // What torch::jit::pickle_save writes (torch.save's zip format), but with the dict
  // pickled as a plain dict: pickle_save tags it with torch.jit._pickle.restore_type_tag,
  // which torch.load's default weights_only=True (PyTorch >= 2.6) refuses to unpickle.
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* p, std::size_t n) { pickled.insert(pickled.end(), p, p + n); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, std::size_t n) {
    sink(static_cast<const char*>(p), n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  for (const auto& [name, text] : records) writer.writeRecord(name, text.data(), text.size());
  writer.writeEndOfFile();
}

state_dict load_state_dict(const std::string& path) { return load_state_dict(read_file_bytes(path), path); }

state_dict load_state_dict(const std::vector<char>& bytes, const std::string& path) {
  if (bytes.empty()) throw checkpoint_error("checkpoint " + path + " is empty");
  try {
    return read_torch_state_dict(bytes);
  } catch (const c10::Error& e) {  // LibTorch's zip reader
    std::string msg = e.what();
    throw checkpoint_error("checkpoint " + path + " is not a readable PyTorch file (" + msg.substr(0, msg.find('\n')) + ")");
  } catch (const std::runtime_error& e) {
    throw checkpoint_error("checkpoint " + path + " is not a readable PyTorch file: " + e.what());
  }
}

}  // namespace troupe
