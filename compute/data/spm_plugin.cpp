// libtroupe_spm.so: Debian's SentencePiece behind the interface of spm_plugin.hpp (see
// there for why it is a plugin).
#include "compute/data/spm_plugin.hpp"

#include <unordered_map>

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

namespace {

using processor = sentencepiece::SentencePieceProcessor;

processor* as_processor(void* p) { return static_cast<processor*>(p); }

void* load(const std::string& model, std::string& error) {
  auto* p = new processor();
  const auto status = p->LoadFromSerializedProto(model);
  if (!status.ok() || p->GetPieceSize() <= 0) {
    error = status.ok() ? "no pieces" : status.ToString();
    delete p;
    return nullptr;
  }
  return p;
}

void release(void* p) { delete as_processor(p); }

int size(void* p) { return as_processor(p)->GetPieceSize(); }

bool encode(void* p, const std::string& text, std::vector<int>& ids, std::string& error) {
  const auto status = as_processor(p)->Encode(text, &ids);
  if (!status.ok()) error = status.ToString();
  return status.ok();
}

bool decode(void* p, const std::vector<int>& ids, std::string& text, std::string& error) {
  const auto status = as_processor(p)->Decode(ids, &text);
  if (!status.ok()) error = status.ToString();
  return status.ok();
}

int kind(void* p, int id) {
  const auto* sp = as_processor(p);
  if (sp->IsControl(id)) return 1;
  if (sp->IsByte(id)) return 2;
  if (sp->IsUnknown(id) || sp->IsUnused(id)) return 3;
  return 0;
}

const std::string* piece(void* p, int id) { return &as_processor(p)->IdToPiece(id); }

/// The lines, one sentence each.
class line_iterator final : public sentencepiece::SentenceIterator {
 public:
  explicit line_iterator(const std::vector<std::string>& lines) : lines_(lines) {}
  bool done() const override { return i_ >= lines_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return lines_[i_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string>& lines_;
  std::size_t i_ = 0;
};

bool train(const std::vector<std::pair<std::string, std::string>>& options, const std::vector<std::string>& lines,
           std::string& model, std::string& error) {
  line_iterator it(lines);
  const std::unordered_map<std::string, std::string> kwargs(options.begin(), options.end());
  const auto status = sentencepiece::SentencePieceTrainer::Train(kwargs, &it, &model);
  if (!status.ok()) error = status.ToString();
  return status.ok();
}

const troupe_spm_api api{load, release, size, encode, decode, kind, piece, train};

}  // namespace

extern "C" const troupe_spm_api* troupe_spm() { return &api; }
