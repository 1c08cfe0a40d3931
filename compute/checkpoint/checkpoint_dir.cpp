#include "compute/checkpoint/checkpoint_dir.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/torch_file.hpp"
#include "compute/models/model.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/runtime/remove_tree.hpp"
#include "compute/data/tokenizer.hpp"

namespace troupe {

namespace fs = std::filesystem;

namespace {

constexpr int manifest_version = 1;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw checkpoint_error("cannot read " + path.string());
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

template <class Bytes>
std::uint32_t crc_of(const Bytes& bytes) {
  return static_cast<std::uint32_t>(
      crc32_z(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

std::string step_folder_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string hash_of(const std::vector<std::pair<std::string, std::string>>& identity) {
  std::string text;
  for (const auto& [k, v] : identity) text += k + "=" + v + "\n";
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", crc_of(text));
  return buf;
}

fs::path tmp_folder(const fs::path& root, std::int64_t step) { return root / ("." + step_folder_name(step) + ".tmp"); }

std::string stage_file_name(int stage, const std::string& kind) {
  return (kind == "parameters" ? "stage-" : "optim-stage-") + std::to_string(stage) + ".pt";
}

/// A step folder's name: "step-" and digits.
bool is_step_folder_name(const std::string& name) {
  return name.size() > 5 && name.rfind("step-", 0) == 0 &&
         std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

/// The step folders of `root`, oldest first.
std::vector<fs::path> step_folders(const fs::path& root) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.is_directory() && is_step_folder_name(e.path().filename().string())) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

/// The folder `latest` names, or "" (with a warning) when it names none that is complete:
/// it is not a file, or holds anything but a step folder's name (NUL bytes, a path).
std::string latest_folder(const fs::path& root) {
  const auto file = root / "latest";
  std::error_code ec;
  if (!fs::exists(file, ec)) return "";
  std::string name, why;
  if (!fs::is_regular_file(file, ec)) {
    why = "is not a file";
  } else {
    try {
      name = read_bytes(file);
    } catch (const checkpoint_error&) {
      why = "cannot be read";
    }
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
    if (why.empty() && !is_step_folder_name(name)) why = "holds no step folder's name";
    if (why.empty() && !fs::exists(root / name / "manifest.json", ec)) why = "names " + name + ", which has no manifest.json";
  }
  if (why.empty()) return (root / name).string();
  spdlog::warn("checkpoint folder {}: 'latest' {}; taking the newest complete step folder", root.string(), why);
  return "";
}

/// A step folder whose bytes are not what its manifest says (a file missing, truncated or
/// changed, a manifest that does not parse): corrupt. Other failures to verify one (a
/// manifest of another version, a read error) are checkpoint_error only.
struct corrupt_checkpoint : checkpoint_error {
  using checkpoint_error::checkpoint_error;
};

/// Every file of step folder `folder` is as its manifest says (size and CRC-32, read in
/// pieces). Throws corrupt_checkpoint naming what is wrong, or checkpoint_error.
void verify_checkpoint_files(const fs::path& folder) {
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_bytes(folder / "manifest.json"));
  } catch (const nlohmann::json::exception& e) {
    throw corrupt_checkpoint(std::string("manifest.json is not valid JSON (") + e.what() + ")");
  }
  try {
    if (manifest.value("format", "") != "troupe-checkpoint" || manifest.value("version", 0) != manifest_version)
      throw checkpoint_error("manifest.json is not a version " + std::to_string(manifest_version) + " Troupe manifest");
    std::vector<char> piece(std::size_t(1) << 20);
    for (const auto& f : manifest.at("files")) {
      const auto name = f.at("name").get<std::string>();
      std::error_code ec;
      if (!fs::exists(folder / name, ec) && !ec) throw corrupt_checkpoint(name + " is missing");
      std::ifstream in(folder / name, std::ios::binary);
      if (!in) throw checkpoint_error("cannot read " + name + ": " + std::strerror(errno));
      std::uint64_t size = 0;
      uLong crc = crc32(0L, Z_NULL, 0);
      while (in) {
        in.read(piece.data(), std::streamsize(piece.size()));
        const auto n = std::size_t(in.gcount());
        crc = crc32_z(crc, reinterpret_cast<const Bytef*>(piece.data()), n);
        size += n;
      }
      if (in.bad()) throw checkpoint_error("cannot read " + name + ": " + std::strerror(errno));
      if (size != f.at("bytes").get<std::uint64_t>() || std::uint32_t(crc) != f.at("crc32").get<std::uint32_t>())
        throw corrupt_checkpoint(name + " is truncated or corrupt (" + std::to_string(size) + " bytes, manifest says " +
                                 std::to_string(f.at("bytes").get<std::uint64_t>()) + ")");
    }
  } catch (const nlohmann::json::exception& e) {
    throw corrupt_checkpoint(std::string("manifest.json lacks a field (") + e.what() + ")");
  }
}

/// Moves a step folder that does not verify out of the way (corrupt-step-N beside it, for
/// inspection): no later run takes it, and a new checkpoint of its step does not remove it.
std::string move_aside(const fs::path& folder) {
  auto to = folder.parent_path() / ("corrupt-" + folder.filename().string());
  for (int i = 2; fs::exists(to); ++i)
    to = folder.parent_path() / ("corrupt-" + folder.filename().string() + "." + std::to_string(i));
  std::error_code ec;
  fs::rename(folder, to, ec);
  return ec ? std::string() : to.string();
}

/// The newest step folder of checkpoint root `root` that verifies ('latest' first, then
/// the step folders newest first), or "" when it has none. Those newer that do not are
/// passed over with a warning and, once one that verifies is found and `move` (the job
/// holds the root's lock), the corrupt ones are moved aside. With `strict` the first that
/// does not verify is refused; when none verifies nothing is moved and the root is
/// refused (a later run refuses it again rather than starting afresh).
std::string newest_sound_checkpoint(const fs::path& root, bool strict, bool move) {
  std::vector<fs::path> candidates;
  if (const auto latest = latest_folder(root); !latest.empty()) candidates.emplace_back(latest);
  auto all = step_folders(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (fs::exists(*it / "manifest.json") && std::find(candidates.begin(), candidates.end(), *it) == candidates.end())
      candidates.push_back(*it);
  std::vector<std::pair<fs::path, bool>> failed;  // (folder, corrupt)
  for (const auto& folder : candidates) {
    try {
      verify_checkpoint_files(folder);
    } catch (const checkpoint_error& e) {
      if (strict)
        throw checkpoint_error("checkpoint " + folder.string() + ": " + e.what() +
                               " (output.strict_resume: no fall-back to an older checkpoint)");
      spdlog::warn("checkpoint {} does not verify ({}); trying the next older one", folder.string(), e.what());
      failed.emplace_back(folder, dynamic_cast<const corrupt_checkpoint*>(&e) != nullptr);
      continue;
    }
    for (const auto& [bad, corrupt] : failed) {
      if (!corrupt || !move) continue;
      const auto kept = move_aside(bad);
      spdlog::warn("checkpoint {} kept for inspection as {}", bad.string(),
                   kept.empty() ? bad.string() + " (it could not be moved)" : kept);
    }
    return folder.string();
  }
  if (!failed.empty())
    throw checkpoint_error("no checkpoint in " + root.string() + " verifies (" + std::to_string(failed.size()) +
                           " did not; see above): refusing to start from step 0 over them; move them away to start "
                           "afresh");
  return "";
}

}  // namespace

std::vector<std::pair<std::string, std::string>> training_identity(const job_config& cfg) {
  static const std::set<std::string> keys = {"train.workload",        "train.steps",          "train.seed",
                                             "optimizer.lr",          "optimizer.min_lr",     "optimizer.warmup",
                                             "optimizer.weight_decay", "optimizer.beta1",     "optimizer.beta2",
                                             "optimizer.eps",         "optimizer.clip",       "data.global_batch"};
  std::vector<std::pair<std::string, std::string>> out;
  // And a text of one's own and its validation text (none: the workload's data, as in
  // manifests from before the keys).
  for (const auto& kv : cfg.values())
    if (keys.count(kv.first) || (kv.first == "data.text" && !cfg.text.empty()) ||
        (kv.first == "data.val_text" && !cfg.val_text.empty()) ||
        // (documents: their paths and field; none in manifests from before the keys)
        (kv.first == "data.data" && cfg.uses_documents()) || (kv.first == "data.val_data" && !cfg.val_data.empty()) ||
        (kv.first == "data.data_field" && cfg.uses_documents()) ||
        (kv.first == "data.document_attention" && cfg.document_attention) ||
        // (a Hugging Face folder's model: its rope scaling, GELU and routing have no key)
        (kv.first == "train.model" && !cfg.hf_model.empty()))
      out.push_back(kv);
  // The model's shape as it resolves ([model] keys, or the workload's own): the weights
  // alone do not tell the number of heads.
  if (cfg.workload != "fmnist-mlp") {
    const auto g = cfg.model().decoder;
    for (const auto& [k, v] : {std::pair<const char*, int>{"model.layers", g.n_layer}, {"model.heads", g.n_head},
                               {"model.d_model", g.d_model}, {"model.d_ff", g.d_ff}, {"model.seq_len", g.seq_len}})
      out.emplace_back(k, std::to_string(v));
    // What the architecture adds (manifests from before these keys: gpt2's, as implied below).
    auto fmt_double = [](double x) {
      std::ostringstream o;
      o.precision(17);
      o << x;
      return o.str();
    };
    out.emplace_back("model.architecture", std::string("\"") + decoder_arch_name(g.arch) + "\"");  // (TOML text)
    out.emplace_back("model.kv_heads", std::to_string(g.kv_heads()));
    out.emplace_back("model.vocab", std::to_string(g.vocab));
    out.emplace_back("model.norm_eps", fmt_double(g.norm_eps));
    out.emplace_back("model.tie_embeddings", g.tie_embeddings ? "true" : "false");
    if (g.arch != decoder_arch::gpt2) out.emplace_back("model.rope_theta", fmt_double(g.rope_theta));
    if (g.head_size > 0) out.emplace_back("model.head_dim", std::to_string(g.head_size));
    if (g.sliding_window > 0) out.emplace_back("model.sliding_window", std::to_string(g.sliding_window));
    if (g.n_experts > 0)  // (a model from a Hugging Face folder need not be a workload with experts)
      for (const auto& [k, v] : {std::pair<const char*, int>{"model.experts", g.n_experts}, {"model.moe_top_k", g.moe_top_k},
                                 {"model.moe_d_ff", g.expert_d_ff()}, {"model.moe_every", g.moe_every}})
        out.emplace_back(k, std::to_string(v));
  }
  return out;
}

std::string begin_checkpoint_dir(const std::string& root_path, std::int64_t next_step) {
  const fs::path root(root_path);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw checkpoint_error("cannot create checkpoint folder " + root_path + ": " + ec.message());
  const auto tmp = tmp_folder(root, next_step);
  remove_tree(tmp.string());
  fs::create_directory(tmp, ec);
  if (ec) throw checkpoint_error("cannot create " + tmp.string() + ": " + ec.message());
  return tmp.string();
}

namespace {

/// Writes `state` as file `file` of the temporary folder `tmp` (atomically), with its
/// size and CRC-32 as they are written.
checkpoint_file write_folder_file(const std::string& tmp, const std::string& file, int stage, const std::string& kind,
                                  const state_dict& state) {
  // Made by the coordinator's process: a node that does not see it does not share
  // checkpoint_dir with it.
  if (!fs::is_directory(tmp))
    throw checkpoint_error(tmp + ", which node 0 made, is not there (with nodes on several hosts, checkpoint_dir "
                           "must be one folder they all share)");
  std::uint64_t size = 0;
  uLong crc = crc32(0L, Z_NULL, 0);
  write_file_atomically((fs::path(tmp) / file).string(), [&](const byte_sink& sink) {
    write_state_dict(state, [&](const char* data, std::size_t n) {
      crc = crc32_z(crc, reinterpret_cast<const Bytef*>(data), n);
      size += n;
      sink(data, n);
    });
  });
  return {file, stage, kind, size, static_cast<std::uint32_t>(crc)};
}

std::string shard_file_name(int stage, int shard) {
  return "stage-" + std::to_string(stage) + "-shard-" + std::to_string(shard) + ".pt";
}

constexpr const char* shard_kind = "shard";

/// A shard file's piece key "KIND.NAME@OFFSET/NUMEL" taken apart; false for another key.
bool parse_piece_key(const std::string& key, std::string& kind_name, std::int64_t& offset, std::int64_t& numel) {
  const auto at = key.rfind('@'), slash = key.rfind('/');
  if (at == std::string::npos || slash == std::string::npos || slash < at) return false;
  try {
    std::size_t used = 0;
    offset = std::stoll(key.substr(at + 1, slash - at - 1), &used);
    if (used != slash - at - 1) return false;
    numel = std::stoll(key.substr(slash + 1), &used);
    if (used != key.size() - slash - 1) return false;
  } catch (const std::exception&) {
    return false;
  }
  kind_name = key.substr(0, at);
  return offset >= 0 && numel > 0;
}

}  // namespace

std::vector<checkpoint_file> write_stage_files(const std::string& tmp, int stage, const state_dict& params,
                                               const state_dict& optim) {
  std::vector<checkpoint_file> out;
  for (auto [kind, state] : {std::pair{"parameters", &params}, std::pair{"optimizer", &optim}})
    out.push_back(write_folder_file(tmp, stage_file_name(stage, kind), stage, kind, *state));
  return out;
}

state_dict shard_file_state(const std::vector<moment_piece>& pieces, int tp_rank, int tp_size, std::int64_t next_step) {
  state_dict out;
  out.emplace_back("step", torch::tensor({next_step}, torch::kInt64));
  out.emplace_back("tensor_parallel_rank", torch::tensor({std::int64_t(tp_rank)}, torch::kInt64));
  out.emplace_back("tensor_parallel_size", torch::tensor({std::int64_t(tp_size)}, torch::kInt64));
  for (const auto& p : pieces)
    out.emplace_back(p.name + "@" + std::to_string(p.offset) + "/" + std::to_string(p.numel), p.data);
  return out;
}

checkpoint_file write_shard_file(const std::string& tmp, int stage, int shard, const state_dict& pieces) {
  return write_folder_file(tmp, shard_file_name(stage, shard), stage, shard_kind, pieces);
}

std::string finish_checkpoint_dir(const std::string& root_path, const job_config& cfg,
                                  const std::vector<checkpoint_file>& files, std::int64_t next_step, int keep) {
  const fs::path root(root_path);
  const auto tmp = tmp_folder(root, next_step);
  // A write that fails (a full disk) leaves no partial folder to take the space.
  struct remove_unless_done {
    fs::path path;
    bool done = false;
    ~remove_unless_done() {
      if (!done) remove_tree(path.string());
    }
  } partial{tmp};

  // Every stage's two files, each where this process sees it, as big as its writer says.
  std::map<std::string, const checkpoint_file*> by_name;
  for (const auto& f : files) by_name[f.name] = &f;
  nlohmann::json entries = nlohmann::json::array();
  for (int k = 0; k < cfg.pipeline; ++k) {
    // A stage's two files, or its shards' (at least one; the reader checks that their
    // pieces cover every parameter).
    std::vector<std::string> names;
    for (const auto& f : files)
      if (f.stage == k && f.kind == shard_kind) names.push_back(f.name);
    if (names.empty()) names = {stage_file_name(k, "parameters"), stage_file_name(k, "optimizer")};
    for (const auto& name : names) {
      auto it = by_name.find(name);
      if (it == by_name.end()) throw checkpoint_error("no " + name + " was written for " + tmp.string());
      const auto& f = *it->second;
      std::error_code ec;
      const auto size = fs::file_size(tmp / name, ec);
      if (ec || size != f.bytes)
        throw checkpoint_error(
            name + " was written (" + std::to_string(f.bytes) + " bytes) but " + (tmp / name).string() +
            (ec ? " is not there" : " has " + std::to_string(size) + " bytes") +
            " (with nodes on several hosts, checkpoint_dir must be one folder they all share)");
      entries.push_back({{"name", f.name}, {"stage", f.stage}, {"kind", f.kind}, {"bytes", f.bytes}, {"crc32", f.crc32}});
    }
  }
  const auto identity = training_identity(cfg);
  nlohmann::json config = nlohmann::json::object();
  for (const auto& [k, v] : identity) config[k] = v;
  nlohmann::json manifest{
      {"format", "troupe-checkpoint"},
      {"version", manifest_version},
      {"step", next_step},
      {"samples_consumed", next_step * cfg.global_batch},
      {"workload", cfg.workload},
      {"layout",
       {{"pipeline", cfg.pipeline},
        {"data_parallel", cfg.data_parallel},
        {"microbatches", cfg.microbatches},
        {"chunks", cfg.chunks},
        {"schedule", cfg.schedule},
        {"tensor_parallel", cfg.tensor_parallel},
        {"shard", cfg.shard}}},
      {"config", config},
      {"config_hash", hash_of(identity)},
      {"files", entries}};
  // The tokenizer by its bytes (a moved file is the same tokenizer), and where it was.
  if (!cfg.tokenizer.empty())
    manifest["tokenizer"] = {{"fingerprint", tokenizer_info_of(cfg.tokenizer).fingerprint}, {"path", cfg.tokenizer}};
  write_file_atomically((tmp / "manifest.json").string(), manifest.dump(2) + "\n");

  // A folder of the same step (from a launch that failed later) is replaced; 'latest'
  // may name it meanwhile: find_checkpoint then takes the newest complete folder.
  const auto name = step_folder_name(next_step);
  const fs::path final_path = root / name;
  remove_tree(final_path.string());
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  if (ec) throw checkpoint_error("cannot rename " + tmp.string() + " to " + final_path.string() + ": " + ec.message());
  partial.done = true;
  write_file_atomically((root / "latest").string(), name + "\n");
  auto all = step_folders(root);
  for (std::size_t i = 0; i + std::size_t(keep) < all.size(); ++i)
    if (all[i] != final_path) remove_tree(all[i].string());
  return final_path.string();
}

void abandon_checkpoint_dir(const std::string& root, std::int64_t next_step) {
  remove_tree(tmp_folder(root, next_step).string());
}

std::string find_checkpoint(const std::string& path) {
  const fs::path p(path);
  if (fs::exists(p / "manifest.json")) return p.string();
  if (!fs::exists(p)) throw checkpoint_error("checkpoint folder " + path + " does not exist");
  if (const auto latest = latest_folder(p); !latest.empty()) return latest;
  // No usable 'latest' (a crash between writing a folder and 'latest'): the newest step
  // folder with a manifest (folders get their final name only when complete).
  auto all = step_folders(p);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (fs::exists(*it / "manifest.json")) return it->string();
  throw checkpoint_error(path + " is not a Troupe checkpoint (no manifest.json, no complete step folder)");
}

namespace {

/// The pieces of a folder's shard files (write_shard_file), put together by name.
struct shard_pieces_read {
  std::vector<named_moments> by_tp;  // the kept parameters' state by tensor-parallel rank
  std::set<std::string> seen;        // every parameter a piece is of
  // Per (tensor-parallel rank, "KIND.NAME"): the part's elements and the pieces' ranges.
  std::map<std::pair<int, std::string>, std::pair<std::int64_t, std::vector<std::pair<std::int64_t, std::int64_t>>>>
      ranges;

  void add(state_dict& state, const fs::path& file, const std::function<bool(const std::string&)>& kept) {
    auto scalar = [&](const char* key) {
      for (const auto& [n, t] : state)
        if (n == key && t.numel() == 1) return t.to(torch::kInt64).item<std::int64_t>();
      throw checkpoint_error(file.string() + " is a shard file without its '" + key + "'");
    };
    const auto size = scalar("tensor_parallel_size"), rank = scalar("tensor_parallel_rank");
    if (size < 1 || rank < 0 || rank >= size || (!by_tp.empty() && std::int64_t(by_tp.size()) != size))
      throw checkpoint_error(file.string() + ": tensor-parallel rank " + std::to_string(rank) + " of " +
                             std::to_string(size) + " does not fit the folder's other shard files");
    by_tp.resize(std::size_t(size));
    for (auto& [key, t] : state) {
      std::string kind_name;
      std::int64_t offset = 0, numel = 0;
      if (key == "step" || key == "tensor_parallel_rank" || key == "tensor_parallel_size") continue;
      const auto dot = key.find('.');
      const auto kind = key.substr(0, dot);
      if (!parse_piece_key(key, kind_name, offset, numel) || dot == std::string::npos ||
          (kind != "main" && kind != "exp_avg" && kind != "exp_avg_sq") || t.dim() != 1 || offset + t.numel() > numel)
        throw checkpoint_error(file.string() + ": '" + key + "' is not a piece KIND.NAME@OFFSET/NUMEL of a flat " +
                               "parameter (" + std::to_string(t.numel()) + " elements)");
      const auto name = kind_name.substr(dot + 1);
      // (Experts are not split over tensor-parallel ranks: their pieces are rank 0's.)
      const int tp = expert_of(name) >= 0 ? 0 : int(rank);
      seen.insert(name);
      auto& r = ranges[{tp, kind_name}];
      if (r.first != 0 && r.first != numel)
        throw checkpoint_error(file.string() + ": '" + key + "' disagrees with another piece on " + kind_name +
                               "'s size (" + std::to_string(r.first) + " elements)");
      r.first = numel;
      r.second.emplace_back(offset, t.numel());
      if (kept(name)) add_moment_piece(by_tp[std::size_t(tp)], {kind_name, offset, numel, t.to(torch::kFloat32)});
    }
  }

  /// Every part's pieces cover it; the kept parameters whole (tensor-parallel parts
  /// joined) into `c` (params shaped, "exp_avg.NAME", "exp_avg_sq.NAME"), the others as
  /// stand-ins of their shape. Throws checkpoint_error.
  void assemble(const model_spec& spec, const std::function<bool(const std::string&)>& kept, checkpoint& c) {
    for (auto& [key, r] : ranges) {
      auto& [numel, pieces] = r;
      std::sort(pieces.begin(), pieces.end());
      std::int64_t covered = 0;
      for (const auto& [offset, n] : pieces) {
        if (offset > covered) break;
        covered = std::max(covered, offset + n);
      }
      if (covered < numel)
        throw checkpoint_error("its shard files lack elements " + std::to_string(covered) + ".. of " + key.second +
                               (by_tp.size() > 1 ? " (tensor-parallel rank " + std::to_string(key.first) + ")" : "") +
                               " (" + std::to_string(numel) + " elements): a shard's file is missing");
    }
    state_dict whole_kept;
    std::map<std::string, std::vector<std::int64_t>> shapes;
    for (const auto& p : all_params(spec)) shapes[p.name] = p.shape;
    for (const auto& name : seen) {
      const auto shape = shapes.find(name);
      if (shape == shapes.end()) continue;  // (named by the caller as not the model's)
      // (Of a parameter every tensor-parallel rank holds whole, rank 0's shards write the
      // pieces; the other ranks' parts of a split one are checked as they are joined.)
      for (const char* kind : {"main.", "exp_avg.", "exp_avg_sq."})
        if (!ranges.count({0, kind + name}))
          throw checkpoint_error("its shard files hold no " + std::string(kind) + name);
      if (kept(name))
        whole_kept.emplace_back(name, torch::zeros({}).expand(shape->second));
      else
        c.params.emplace(name, torch::zeros({}).expand(shape->second));
    }
    for (const auto& name : seen)
      if (!shapes.count(name)) c.params.emplace(name, torch::zeros({}));  // refused below, by name
    named_moments whole;
    try {
      whole = by_tp.size() == 1 ? std::move(by_tp.front()) : unshard_moments(spec, whole_kept, by_tp);
    } catch (const std::exception& e) {
      throw checkpoint_error(std::string("its shard files' tensor-parallel parts do not fit together: ") + e.what());
    }
    by_tp.clear();
    for (auto& [name, t] : optimizer_state_dict(whole, whole_kept, 0))
      if (name != "step") c.optim[name] = t;
    use_main_params(whole_kept, whole);  // (the stand-ins' shapes)
    for (auto& [name, t] : whole_kept) c.params[name] = t;
  }
};

}  // namespace

checkpoint read_checkpoint_dir(const std::string& folder, const job_config& cfg,
                               const std::function<bool(const std::string&)>& keep) {
  const fs::path dir(folder);
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_bytes(dir / "manifest.json"));
  } catch (const nlohmann::json::exception& e) {
    throw checkpoint_error("checkpoint " + folder + ": manifest.json is not valid JSON (" + e.what() + ")");
  }
  try {
    if (manifest.value("format", "") != "troupe-checkpoint" || manifest.value("version", 0) != manifest_version)
      throw checkpoint_error("checkpoint " + folder + ": manifest.json is not a version " +
                             std::to_string(manifest_version) + " Troupe manifest");
    // The run must be the one that wrote the checkpoint: same model, data and optimizer.
    std::string differ;
    const auto& saved = manifest.at("config");
    // Manifests written before the [model] keys (or, of the moe workloads, before the
    // experts' keys) lack those model.* entries: their model was their workload's own.
    std::map<std::string, std::string> implied;
    for (const char* workload : {"gpt-tiny", "gpt-small", "moe-tiny", "moe-small"}) {
      const auto own = training_identity(job_config::defaults_for(workload));
      if (std::find(own.begin(), own.end(), std::pair<std::string, std::string>{
                        "train.workload", saved.value("train.workload", std::string())}) == own.end())
        continue;
      for (const auto& [k, v] : own)
        if (k.rfind("model.", 0) == 0) implied[k] = v;
    }
    const auto mine = training_identity(cfg);
    for (const auto& [k, v] : mine) {
      const std::string theirs = saved.contains(k)  ? saved.at(k).get<std::string>()
                                 : implied.count(k) ? implied.at(k)
                                                    : "(absent)";
      if (theirs != v) differ += (differ.empty() ? "" : ", ") + k + " " + theirs + " (checkpoint) vs " + v + " (this run)";
    }
    for (const auto& [k, v] : saved.items())  // what the checkpoint's run had and this one has not (data.text)
      if (std::none_of(mine.begin(), mine.end(), [&](const auto& kv) { return kv.first == k; }))
        differ += (differ.empty() ? "" : ", ") + k + " " + v.get<std::string>() + " (checkpoint) vs (absent) (this run)";
    if (!differ.empty())
      throw checkpoint_error("checkpoint " + folder + " was written by another training configuration: " + differ +
                             "; it would not continue the same run");
    // The tokenizer's bytes, not only its path: the same file name with other pieces is another run.
    const std::string theirs =
        manifest.contains("tokenizer") ? manifest.at("tokenizer").at("fingerprint").get<std::string>() : "";
    const std::string mine_tok = cfg.tokenizer.empty() ? "" : tokenizer_info_of(cfg.tokenizer).fingerprint;
    if (theirs != mine_tok)
      throw checkpoint_error("checkpoint " + folder + " was trained " +
                             (theirs.empty() ? std::string("on bytes") : "with a tokenizer of " + theirs) + "; this run's " +
                             (mine_tok.empty() ? std::string("has none") : "tokenizer " + cfg.tokenizer + " has " + mine_tok));
    const std::int64_t step = manifest.at("step").get<std::int64_t>();
    if (step < 0 || step > cfg.steps)
      throw checkpoint_error("checkpoint " + folder + " is at step " + std::to_string(step) + ", outside a run of " +
                             std::to_string(cfg.steps) + " steps");
    checkpoint c;
    c.step = step;
    // One file at a time, each read once (its CRC, then its tensors from the same bytes);
    // of a parameter not kept only a stand-in of its shape and type stays (no memory),
    // so that the whole model is still checked.
    const auto kept = [&](const std::string& name) { return !keep || keep(name); };
    shard_pieces_read shards;
    for (const auto& f : manifest.at("files")) {
      const auto file = f.at("name").get<std::string>();
      std::vector<char> bytes;
      try {
        bytes = read_file_bytes((dir / file).string());
      } catch (const checkpoint_error&) {
        throw checkpoint_error("checkpoint " + folder + ": " + file + " is missing");
      }
      if (bytes.size() != f.at("bytes").get<std::size_t>() || crc_of(bytes) != f.at("crc32").get<std::uint32_t>())
        throw checkpoint_error("checkpoint " + folder + ": " + file + " is truncated or corrupt (" +
                               std::to_string(bytes.size()) + " bytes, manifest says " +
                               std::to_string(f.at("bytes").get<std::size_t>()) + "; CRC-32 " +
                               (crc_of(bytes) == f.at("crc32").get<std::uint32_t>() ? "matches" : "differs") + ")");
      auto state = load_state_dict(bytes, (dir / file).string());
      bytes = {};
      if (f.at("kind") == shard_kind) {
        shards.add(state, dir / file, kept);
        continue;
      }
      const bool parameters = f.at("kind") == "parameters";
      for (auto& [n, t] : state) {
        if (parameters)
          c.params.emplace(n, kept(n) ? std::move(t) : torch::zeros({}, t.options()).expand(t.sizes()));
        else if (const auto dot = n.find('.'); dot == std::string::npos || kept(n.substr(dot + 1)))
          c.optim.emplace(n, std::move(t));  // "exp_avg.NAME", "exp_avg_sq.NAME"
      }
    }
    try {
      if (!shards.seen.empty()) shards.assemble(cfg.model(), kept, c);
    } catch (const checkpoint_error& e) {
      throw checkpoint_error("checkpoint " + folder + ": " + e.what());
    }
    // Model order as the spec names it; check_state says what is missing or mis-shaped.
    state_dict model;
    for (const auto& n : parameter_names(cfg.model()))
      if (c.params.count(n)) model.emplace_back(n, c.params.at(n));
    if (model.size() != c.params.size())
      throw checkpoint_error("checkpoint " + folder + " holds parameters the " + cfg.workload + " model does not have");
    try {
      check_state(cfg.model(), model);
    } catch (const std::exception& e) {
      throw checkpoint_error("checkpoint " + folder + ": " + e.what());
    }
    c.model.clear();
    for (auto& entry : model)
      if (kept(entry.first)) c.model.push_back(std::move(entry));
    for (auto it = c.params.begin(); it != c.params.end();)
      it = kept(it->first) ? std::next(it) : c.params.erase(it);
    c.optim["step"] = torch::tensor({step}, torch::kInt64);
    const auto& layout = manifest.at("layout");
    if (layout.at("pipeline") != cfg.pipeline || layout.at("data_parallel") != cfg.data_parallel)
      spdlog::info("checkpoint {} was written by pipeline {} x data-parallel {}; resharding for {} x {} (parameters "
                   "and optimizer state by name; results equal to the old layout's up to float summation order)",
                   folder, layout.at("pipeline").get<int>(), layout.at("data_parallel").get<int>(), cfg.pipeline,
                   cfg.data_parallel);
    return c;
  } catch (const nlohmann::json::exception& e) {
    throw checkpoint_error("checkpoint " + folder + ": manifest.json lacks a field (" + e.what() + ")");
  }
}

namespace {

/// TOML text of (key, TOML value) pairs ("model.layers", "4"), by section; one process's
/// micro-batches (whatever the run's batch was, 1 divides it).
std::string as_toml(const std::vector<std::pair<std::string, std::string>>& keys) {
  std::map<std::string, std::string> sections;  // "train" -> "workload = ...\n..."
  for (const auto& [key, value] : keys) {
    const auto dot = key.find('.');
    sections[key.substr(0, dot)] += key.substr(dot + 1) + " = " + value + "\n";
  }
  sections["parallel"] += "microbatches = 1\n";
  std::string text;
  for (const auto& [section, body] : sections) text += "[" + section + "]\n" + body;
  return text;
}

}  // namespace

std::string saved_model_toml(const job_config& cfg) {
  std::vector<std::pair<std::string, std::string>> keys;
  for (const auto& kv : training_identity(cfg))
    if (kv.first == "train.workload" || kv.first == "train.model" || kv.first.rfind("model.", 0) == 0) keys.push_back(kv);
  for (const auto& kv : cfg.values())
    if (kv.first == "data.tokenizer" && !cfg.tokenizer.empty()) keys.push_back(kv);
  return as_toml(keys);
}

std::optional<job_config> saved_model_config(const std::string& path) {
  // (A file that cannot be read has no record: its reader names what is wrong with it.)
  const auto text = read_torch_file_record(path, model_record_name);
  if (text.empty()) return std::nullopt;
  try {
    return job_config_from_toml(text, path + "'s record of its model");
  } catch (const config_error& e) {
    throw checkpoint_error(e.what());
  }
}

job_config checkpoint_job_config(const std::string& folder) {
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_bytes(fs::path(folder) / "manifest.json"));
    std::vector<std::pair<std::string, std::string>> keys;
    for (const auto& [key, value] : manifest.at("config").items()) keys.emplace_back(key, value.get<std::string>());
    if (manifest.contains("tokenizer"))  // where the run's tokenizer was (read_checkpoint_dir checks its bytes)
      keys.emplace_back("data.tokenizer", nlohmann::json(manifest.at("tokenizer").at("path").get<std::string>()).dump());
    return job_config_from_toml(as_toml(keys), "checkpoint " + folder + "/manifest.json");
  } catch (const nlohmann::json::exception& e) {
    throw checkpoint_error("checkpoint " + folder + ": manifest.json is not valid (" + e.what() + ")");
  } catch (const config_error& e) {
    throw checkpoint_error(e.what());
  }
}

void resolve_resume(job_config& cfg, bool restarted) {
  const bool from_root = restarted || cfg.resume == "auto" ||
                         (!cfg.resume.empty() && !fs::exists(fs::path(cfg.resume) / "manifest.json"));
  if (!from_root) return;  // none, or a step folder itself (read_checkpoint_dir checks it whole)
  std::error_code ec;
  const bool has_root = !cfg.checkpoint_dir.empty() && fs::is_directory(cfg.checkpoint_dir, ec);
  // (Folders are moved aside only in the job's own checkpoint_dir, which it holds locked.)
  if (restarted && has_root) {
    if (auto found = newest_sound_checkpoint(cfg.checkpoint_dir, cfg.strict_resume, true); !found.empty()) {
      cfg.resume = std::move(found);
      return;
    }
  }
  if (cfg.resume == "auto") {
    cfg.resume = has_root ? newest_sound_checkpoint(cfg.checkpoint_dir, cfg.strict_resume, true) : "";
    if (cfg.resume.empty())
      spdlog::info("resume = auto: no checkpoint in {} yet, starting from step 0", cfg.checkpoint_dir);
    return;
  }
  if (cfg.resume.empty() || fs::exists(fs::path(cfg.resume) / "manifest.json")) return;
  if (!fs::exists(cfg.resume)) throw checkpoint_error("checkpoint folder " + cfg.resume + " does not exist");
  std::error_code same_ec;
  const bool own = !cfg.checkpoint_dir.empty() && fs::equivalent(cfg.resume, cfg.checkpoint_dir, same_ec);
  auto found = newest_sound_checkpoint(cfg.resume, cfg.strict_resume, own);
  if (found.empty())
    throw checkpoint_error(cfg.resume + " is not a Troupe checkpoint (no manifest.json, no complete step folder)");
  cfg.resume = std::move(found);
}

bool report_complete_run(const job_config& cfg) {
  if (cfg.resume.empty()) return false;
  std::int64_t step = -1;
  try {
    step = nlohmann::json::parse(read_bytes(fs::path(cfg.resume) / "manifest.json")).at("step").get<std::int64_t>();
  } catch (const nlohmann::json::exception&) {
    return false;  // read_checkpoint_dir says what is wrong with it
  }
  if (step < cfg.steps) return false;
  // Checked whole, as a resume would: intact, and this run's (its training configuration).
  const auto ckpt = read_checkpoint_dir(cfg.resume, cfg);
  spdlog::info("the run is already complete: checkpoint {} is at step {} of {}; nothing to train", cfg.resume, step,
               cfg.steps);
  if (cfg.save.empty()) return true;
  state_dict optim{{"step", ckpt.optim.at("step")}};
  for (const auto& [name, p] : ckpt.model)
    for (const char* moment : {"exp_avg.", "exp_avg_sq."})
      if (auto it = ckpt.optim.find(moment + name); it != ckpt.optim.end()) optim.emplace_back(it->first, it->second);
  save_state_dict_pair(cfg.save, ckpt.model, optim, ckpt.step, saved_model_toml(cfg));
  spdlog::info("step {}: checkpoint written to {} (and {}.optim) from {}", ckpt.step, cfg.save, cfg.save, cfg.resume);
  return true;
}

namespace {

/// A file can be made in `folder` (made and removed again).
void require_writable_folder(const fs::path& folder, const std::string& key, const std::string& value) {
  std::error_code ec;
  const auto dir = folder.empty() ? fs::path(".") : folder;
  if (!fs::is_directory(dir, ec))
    throw config_error(key + " = '" + value + "': folder " + dir.string() + " does not exist");
  const auto probe = dir / (".troupe-write-check-" + std::to_string(::getpid()));
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  if (!f) throw config_error(key + " = '" + value + "': cannot write in " + dir.string() + ": " + std::strerror(errno));
  std::fclose(f);
  fs::remove(probe, ec);
}

void require_writable_file(const std::string& path, const std::string& key) {
  if (path.empty()) return;
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw config_error(key + " = '" + path + "' is a folder, not a file");
  require_writable_folder(fs::path(path).parent_path(), key, path);
}

}  // namespace

void lock_checkpoint_dir(const std::string& dir, double wait_seconds) {
  static std::mutex mutex;
  static std::map<std::string, int> held;  // folder -> its lock's descriptor, open until the process ends
  std::error_code ec;
  const auto key = fs::weakly_canonical(dir, ec).string();
  std::lock_guard<std::mutex> lock(mutex);
  if (held.count(key)) return;
  const auto path = fs::path(dir) / ".lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    throw config_error("output.checkpoint_dir = '" + dir + "': cannot open its lock file " + path.string() + ": " +
                       std::strerror(errno));
  // A restarted job may find the lock of its previous launch's node 0 still held for a
  // moment (a process the launcher is ending on another host, an NFS lease): it waits.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_seconds);
  int locked = ::flock(fd, LOCK_EX | LOCK_NB);
  while (locked != 0 && errno == EWOULDBLOCK && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    locked = ::flock(fd, LOCK_EX | LOCK_NB);
  }
  if (locked != 0 && (errno == ENOSYS || errno == ENOLCK || errno == EOPNOTSUPP || errno == EINVAL)) {
    spdlog::warn("checkpoint_dir {}: its file system cannot lock {} ({}): nothing keeps a second job from writing "
                 "into it",
                 dir, path.string(), std::strerror(errno));
    held[key] = fd;
    return;
  }
  if (locked != 0) {
    const int e = errno;
    char buf[256] = {};
    const auto n = ::pread(fd, buf, sizeof buf - 1, 0);
    std::string holder = n > 0 ? std::string(buf, std::size_t(n)) : std::string("another process");
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd);
    if (e == EWOULDBLOCK)
      throw config_error("output.checkpoint_dir = '" + dir + "' is in use by another running job (" + holder +
                         "; its lock " + path.string() +
                         "): two jobs would overwrite each other's checkpoints; give this job another "
                         "checkpoint_dir, or end the other one");
    throw config_error("output.checkpoint_dir = '" + dir + "': cannot lock " + path.string() + ": " +
                       std::strerror(e));
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  char when[64] = {};
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  const auto text = "pid " + std::to_string(::getpid()) + " on " + host + ", since " + when + "\n";
  // (Who holds it is for a refusal's message only: a failed write changes nothing else.)
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) < 0)
    spdlog::debug("cannot write who holds {}: {}", path.string(), std::strerror(errno));
  held[key] = fd;
}

void check_output_paths(const job_config& cfg, double lock_wait_seconds) {
  // What one checkpoint of the model takes: fp32 parameters and AdamW's two moments.
  const double checkpoint_bytes = double(parameter_count(cfg.model())) * 12;
  require_writable_file(cfg.save, "output.save");  // its ".optim" goes beside it
  if (!cfg.save.empty()) {
    // The new pair is written in full beside the old one before it replaces it.
    std::error_code ec;
    const auto dir = fs::path(cfg.save).has_parent_path() ? fs::path(cfg.save).parent_path() : fs::path(".");
    const auto space = fs::space(dir, ec);
    if (!ec && double(space.available) < checkpoint_bytes)
      spdlog::warn("output.save {}: its folder has {:.0f} MB free; the pair it writes (and {}.optim) takes about {:.0f} "
                   "MB: a save that does not fit is logged and skipped (the run's last must fit)",
                   cfg.save, double(space.available) / 1e6, cfg.save, checkpoint_bytes / 1e6);
  }
  require_writable_file(cfg.metrics, "output.metrics");
  require_writable_file(cfg.trace, "output.trace");
  if (!cfg.checkpoint_dir.empty()) {
    std::error_code ec;
    fs::create_directories(cfg.checkpoint_dir, ec);
    if (ec)
      throw config_error("output.checkpoint_dir = '" + cfg.checkpoint_dir + "': cannot create it: " + ec.message());
    require_writable_folder(cfg.checkpoint_dir, "output.checkpoint_dir", cfg.checkpoint_dir);
    lock_checkpoint_dir(cfg.checkpoint_dir, lock_wait_seconds);
    // A checkpoint that does not fit is logged and the run goes on without it: say so now
    // if the folder's file system is short of the space the checkpoints will take (the
    // keep_checkpoints newest, and the next one, written before the oldest is removed).
    const auto space = fs::space(cfg.checkpoint_dir, ec);
    if (!ec) {
      const double each = checkpoint_bytes;
      const double have = double(step_folders(cfg.checkpoint_dir).size());
      const double more = each * std::max(1.0, cfg.keep_checkpoints + 1 - have);
      if (double(space.available) < more)
        spdlog::warn("checkpoint_dir {} has {:.0f} MB free; a checkpoint takes about {:.0f} MB, keep_checkpoints = {} "
                     "needs about {:.0f} MB more: checkpoints that do not fit are logged and skipped (the run's last "
                     "must fit)",
                     cfg.checkpoint_dir, double(space.available) / 1e6, each / 1e6, cfg.keep_checkpoints, more / 1e6);
    }
  }
}

}  // namespace troupe
