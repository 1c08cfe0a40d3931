#include "compute/data/documents.hpp"

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "compute/runtime/file_bytes.hpp"
#include "compute/runtime/splitmix.hpp"

namespace troupe {

namespace fs = std::filesystem;

namespace {

constexpr char megatron_magic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr char docs_magic[8] = {'T', 'R', 'P', 'D', 'O', 'C', '0', '1'};

struct docs_header {
  char magic[8];
  std::uint64_t fingerprint;
};

std::string hex64(std::uint64_t x) {
  char text[20];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(x));
  return text;
}

bool megatron_prefix(const std::string& path) {
  return fs::is_regular_file(path + ".bin") && fs::is_regular_file(path + ".idx");
}

}  // namespace

std::string files_fingerprint(const std::vector<std::string>& files) {
  // Once per process per set of files as they are (path, size, modification time): a
  // job asks for it at start, at join and for its cache's name, and a corpus may hold
  // gigabytes.
  std::string key;
  for (const auto& file : files) {
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) throw data_error("cannot read " + file);
    key += file + "\n" + std::to_string(st.st_size) + "\n" + std::to_string(st.st_mtim.tv_sec) + "." +
           std::to_string(st.st_mtim.tv_nsec) + "\n";
  }
  static std::mutex m;
  static std::map<std::string, std::string> known;
  {
    std::lock_guard<std::mutex> lock(m);
    const auto it = known.find(key);
    if (it != known.end()) return it->second;
  }
  std::uint64_t hash = fnv1a_basis, bytes = 0;
  std::vector<char> chunk(1 << 20);
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw data_error("cannot read " + file);
    while (in) {
      in.read(chunk.data(), std::streamsize(chunk.size()));
      const auto n = std::size_t(in.gcount());
      hash = fnv1a(chunk.data(), n, hash);
      bytes += n;
    }
    if (in.bad()) throw data_error("cannot read " + file);
  }
  auto text = std::to_string(bytes) + " bytes, fnv1a " + hex64(hash);
  std::lock_guard<std::mutex> lock(m);
  return known.emplace(key, std::move(text)).first->second;
}

data_format data_format_of(const std::string& path) {
  if (fs::is_directory(path)) return data_format::folder;
  if (fs::path(path).extension() == ".jsonl" && fs::is_regular_file(path)) return data_format::json_lines;
  if (megatron_prefix(path)) return data_format::megatron;
  if (fs::is_regular_file(path)) return data_format::file;
  if (fs::is_regular_file(path + ".bin") || fs::is_regular_file(path + ".idx"))
    throw data_error("data " + path + ": a Megatron dataset needs both " + path + ".bin and " + path + ".idx; " +
                     (fs::is_regular_file(path + ".bin") ? path + ".idx" : path + ".bin") + " is missing");
  throw data_error("data " + path + " does not exist (a .jsonl file, a Megatron prefix with .bin and .idx, a file or "
                   "a folder)");
}

const char* data_format_name(data_format f) {
  switch (f) {
    case data_format::json_lines: return "JSON lines";
    case data_format::megatron: return "Megatron indexed dataset";
    case data_format::file: return "file";
    case data_format::folder: return "folder";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------
// Megatron's format

megatron_index read_megatron_index(const std::string& prefix) {
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  std::vector<char> bytes;
  try {
    bytes = read_file_bytes(idx);
  } catch (const std::exception& e) {
    throw data_error("Megatron index " + idx + ": " + e.what());
  }
  const auto bad = [&](const std::string& what) { return data_error("Megatron index " + idx + ": " + what); };
  std::size_t at = 0;
  auto take = [&](void* out, std::size_t n) {
    if (at + n > bytes.size()) throw bad("ends at byte " + std::to_string(bytes.size()) + ", inside its header or tables");
    std::memcpy(out, bytes.data() + at, n);
    at += n;
  };
  char magic[9];
  take(magic, 9);
  if (std::memcmp(magic, megatron_magic, 9) != 0) throw bad("not an MMIDIDX index (wrong magic bytes)");
  std::uint64_t version = 0, sequences = 0, documents = 0;
  std::uint8_t code = 0;
  take(&version, 8);
  if (version != 1) throw bad("version " + std::to_string(version) + " (Troupe reads version 1)");
  take(&code, 1);
  megatron_index x;
  x.dtype_code = code;
  switch (code) {
    case 1: x.width = 1; x.is_signed = false; break;
    case 2: x.width = 1; x.is_signed = true; break;
    case 3: x.width = 2; x.is_signed = true; break;
    case 4: x.width = 4; x.is_signed = true; break;
    case 5: x.width = 8; x.is_signed = true; break;
    case 8: x.width = 2; x.is_signed = false; break;
    case 6:
    case 7: throw bad("dtype code " + std::to_string(code) + " is floating-point: token ids are integers");
    default: throw bad("unknown dtype code " + std::to_string(code) + " (known: 1-8)");
  }
  take(&sequences, 8);
  take(&documents, 8);
  if (sequences > bytes.size() || documents > bytes.size()) throw bad("counts larger than the file");
  x.sequence_lengths.resize(sequences);
  x.sequence_pointers.resize(sequences);
  x.document_indices.resize(documents);
  take(x.sequence_lengths.data(), 4 * sequences);
  take(x.sequence_pointers.data(), 8 * sequences);
  take(x.document_indices.data(), 8 * documents);
  std::int64_t expect = 0;
  for (std::size_t i = 0; i < sequences; ++i) {
    if (x.sequence_lengths[i] < 0) throw bad("sequence " + std::to_string(i) + " has a negative length");
    if (x.sequence_pointers[i] != expect)
      throw bad("sequence " + std::to_string(i) + " starts at byte " + std::to_string(x.sequence_pointers[i]) +
                " of the .bin, not " + std::to_string(expect) + " (sequences stored out of order)");
    expect += std::int64_t(x.sequence_lengths[i]) * x.width;
    x.tokens += std::uint64_t(x.sequence_lengths[i]);
  }
  if (documents == 0 || x.document_indices.front() != 0 || std::uint64_t(x.document_indices.back()) != sequences)
    throw bad("its document indices do not run from 0 to its " + std::to_string(sequences) + " sequences");
  for (std::size_t i = 1; i < documents; ++i)
    if (x.document_indices[i] < x.document_indices[i - 1]) throw bad("its document indices decrease");
  std::error_code ec;
  const auto bin_size = fs::file_size(bin, ec);
  if (ec) throw data_error("Megatron data " + bin + ": " + ec.message());
  if (bin_size != std::uint64_t(expect))
    throw data_error("Megatron dataset " + prefix + ": " + idx + " describes " + std::to_string(x.tokens) +
                     " tokens of " + std::to_string(x.width) + " bytes (" + std::to_string(expect) + " bytes) but " +
                     bin + " holds " + std::to_string(bin_size) + " bytes: the index is not this .bin's");
  return x;
}

megatron_writer::megatron_writer(const std::string& prefix, int vocab_size)
    : prefix_(prefix), bin_tmp_(prefix + ".bin.tmp"), code_(vocab_size < 65500 ? 8 : 4) {
  const auto dir = fs::path(prefix).parent_path();
  std::error_code ec;
  if (!dir.empty()) fs::create_directories(dir, ec);
  bin_ = std::fopen(bin_tmp_.c_str(), "wb");
  if (!bin_) throw data_error("cannot write " + bin_tmp_ + ": " + std::strerror(errno));
}

megatron_writer::~megatron_writer() {
  if (bin_) {
    std::fclose(bin_);
    std::remove(bin_tmp_.c_str());
  }
}

void megatron_writer::add_document(const std::vector<int>& ids) {
  if (code_ == 8) {
    std::vector<std::uint16_t> narrow(ids.begin(), ids.end());
    if (std::fwrite(narrow.data(), 2, narrow.size(), bin_) != narrow.size())
      throw data_error("cannot write " + bin_tmp_ + ": " + std::strerror(errno));
  } else if (std::fwrite(ids.data(), 4, ids.size(), bin_) != ids.size()) {
    throw data_error("cannot write " + bin_tmp_ + ": " + std::strerror(errno));
  }
  lengths_.push_back(std::int32_t(ids.size()));
  tokens_ += ids.size();
}

void megatron_writer::finish() {
  if (std::fflush(bin_) != 0 || std::fclose(bin_) != 0) {
    bin_ = nullptr;
    throw data_error("cannot write " + bin_tmp_ + ": " + std::strerror(errno));
  }
  bin_ = nullptr;
  const int width = code_ == 8 ? 2 : 4;
  write_file_atomically(prefix_ + ".idx", [&](const byte_sink& sink) {
    sink(megatron_magic, 9);
    const std::uint64_t version = 1, n = lengths_.size(), docs = lengths_.size() + 1;
    const auto code = std::uint8_t(code_);
    sink(reinterpret_cast<const char*>(&version), 8);
    sink(reinterpret_cast<const char*>(&code), 1);
    sink(reinterpret_cast<const char*>(&n), 8);
    sink(reinterpret_cast<const char*>(&docs), 8);
    sink(reinterpret_cast<const char*>(lengths_.data()), 4 * lengths_.size());
    std::vector<std::int64_t> pointers(lengths_.size()), indices(lengths_.size() + 1);
    std::int64_t at = 0;
    for (std::size_t i = 0; i < lengths_.size(); ++i) {
      pointers[i] = at;
      at += std::int64_t(lengths_[i]) * width;
      indices[i + 1] = std::int64_t(i + 1);
    }
    sink(reinterpret_cast<const char*>(pointers.data()), 8 * pointers.size());
    sink(reinterpret_cast<const char*>(indices.data()), 8 * indices.size());
  });
  rename_into_place(bin_tmp_, prefix_ + ".bin");
}

// ---------------------------------------------------------------------------------------
// Text documents

void for_each_document(const std::string& path, const std::string& field,
                       const std::function<void(std::string&& text, const std::string& where)>& each) {
  const auto format = data_format_of(path);
  if (format == data_format::megatron) throw data_error("data " + path + " is a Megatron dataset: its ids are stored");
  if (format == data_format::json_lines) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw data_error("cannot read " + path);
    std::string line;
    for (std::size_t number = 1; std::getline(in, line); ++number) {
      if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;
      const std::string where = path + ":" + std::to_string(number);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::parse_error& e) {
        throw data_error(where + ": not a JSON line (" + std::string(e.what()) + ")");
      }
      if (!j.is_object() || !j.contains(field))
        throw data_error(where + ": no field '" + field + "' (name the document's field with --data-field)");
      if (!j.at(field).is_string()) throw data_error(where + ": field '" + field + "' is not a string");
      each(j.at(field).get<std::string>(), where);
    }
    if (in.bad()) throw data_error("cannot read " + path);
    return;
  }
  for (const auto& file : text_corpus::text_files(path)) {
    const auto bytes = read_file_bytes(file);
    each(std::string(bytes.begin(), bytes.end()), file);
  }
}

void encode_documents(const std::string& path, const std::string& field, const tokenizer& tok, int eos, int threads,
                      const std::function<void(const std::vector<int>& ids)>& each) {
  threads = std::max(1, threads);
  std::vector<std::string> texts, wheres;
  std::size_t held = 0;
  auto flush = [&] {
    std::vector<std::vector<int>> ids(texts.size());
    std::vector<std::string> errors{std::size_t(threads)};
    auto work = [&](int t) {
      try {
        for (std::size_t i = std::size_t(t); i < texts.size(); i += std::size_t(threads)) {
          try {
            ids[i] = tok.encode(texts[i]);
          } catch (const std::exception& e) {
            throw data_error(wheres[i] + ": " + e.what());
          }
          if (eos >= 0 && (ids[i].empty() || ids[i].back() != eos)) ids[i].push_back(eos);
        }
      } catch (const std::exception& e) {
        errors[std::size_t(t)] = e.what();
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
    work(0);
    for (auto& th : pool) th.join();
    for (const auto& e : errors)
      if (!e.empty()) throw data_error(e);
    for (const auto& d : ids) each(d);
    texts.clear();
    wheres.clear();
    held = 0;
  };
  for_each_document(path, field, [&](std::string&& text, const std::string& where) {
    held += text.size();
    texts.push_back(std::move(text));
    wheres.push_back(where);
    if (held >= (std::size_t(8) << 20) * std::size_t(threads)) flush();
  });
  flush();
}

int document_eos(const std::string& model_dir, int tokenizer_eos) {
  const auto config = fs::path(model_dir) / "config.json";
  if (!model_dir.empty() && fs::is_regular_file(config)) {
    try {
      const auto j = nlohmann::json::parse(read_file_bytes(config.string()));
      const auto& e = j.contains("eos_token_id") ? j.at("eos_token_id") : nlohmann::json();
      if (e.is_number_integer()) return e.get<int>();
      if (e.is_array() && !e.empty() && e.at(0).is_number_integer()) return e.at(0).get<int>();
    } catch (const nlohmann::json::exception& e) {
      throw data_error(config.string() + ": " + e.what());
    }
  }
  return tokenizer_eos;
}

std::string data_fingerprint(const std::string& path) {
  switch (data_format_of(path)) {
    case data_format::megatron: {
      std::error_code ec;
      const auto bin = fs::file_size(path + ".bin", ec);
      return "index " + files_fingerprint({path + ".idx"}) + ", data " + std::to_string(bin) + " bytes";
    }
    case data_format::json_lines:
    case data_format::file: return files_fingerprint({path});
    case data_format::folder: return files_fingerprint(text_corpus::text_files(path));
  }
  return "";
}

std::shared_ptr<const token_file> data_tokens(const std::string& path, const std::string& field, const tokenizer* tok,
                                              int eos, const std::string& cache_dir, bool* written) {
  if (written) *written = false;
  const auto format = data_format_of(path);
  if (format == data_format::megatron) {
    const auto index = read_megatron_index(path);
    return std::make_shared<const token_file>(path + ".bin", 0, index.tokens, index.width, index.is_signed,
                                              "Megatron data");
  }
  if (!tok) throw data_error("data " + path + ": its documents need a tokenizer (--model DIR or --tokenizer)");
  const std::string identity = "documents " + data_fingerprint(path) + "; format " + data_format_name(format) +
                               (format == data_format::json_lines ? "; field " + field : "") + "; tokenizer " +
                               tok->fingerprint() + "; eos " + std::to_string(eos);
  const std::uint64_t fingerprint = fnv1a(identity.data(), identity.size());
  const fs::path dir = cache_dir.empty() ? fs::path(default_cache_dir()) : fs::path(cache_dir);
  const std::string file = (dir / ("docs-" + hex64(fingerprint) + ".bin")).string();
  if (!fs::exists(file)) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw data_error("cannot make the token cache folder " + dir.string() + ": " + ec.message());
    write_file_atomically(file, [&](const byte_sink& sink) {
      docs_header h{};
      std::memcpy(h.magic, docs_magic, 8);
      h.fingerprint = fingerprint;
      sink(reinterpret_cast<const char*>(&h), sizeof h);
      const int threads = int(std::max(1u, std::thread::hardware_concurrency()));
      encode_documents(path, field, *tok, eos, threads, [&](const std::vector<int>& ids) {
        sink(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
      });
    });
    if (written) *written = true;
  }
  docs_header h{};
  std::ifstream in(file, std::ios::binary);
  in.read(reinterpret_cast<char*>(&h), sizeof h);
  std::error_code ec;
  const auto size = fs::file_size(file, ec);
  if (!in || ec || std::memcmp(h.magic, docs_magic, 8) != 0 || h.fingerprint != fingerprint ||
      (size - sizeof h) % 4 != 0)
    throw data_error("token cache " + file + " is not the cache of " + path + " (a fingerprint or size that " +
                     "disagrees): remove it and run again");
  return std::make_shared<const token_file>(file, sizeof h, (size - sizeof h) / 4, 4, true, "the token cache");
}

}  // namespace troupe
