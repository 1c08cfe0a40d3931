#include "compute/checkpoint/torch_file.hpp"

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

namespace troupe {

namespace {

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

/// The zip archive's bytes, as PyTorchStreamReader reads them.
class bytes_adapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit bytes_adapter(const std::vector<char>& bytes) : bytes_(bytes) {}
  std::size_t size() const override { return bytes_.size(); }
  std::size_t read(std::uint64_t pos, void* buf, std::size_t n, const char*) const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<std::size_t>(n, bytes_.size() - std::size_t(pos));
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  const std::vector<char>& bytes_;
};

/// A value on the pickle machine's stack. Reference semantics (shared_ptr), as in Python:
/// the memo and the stack share objects, and a dict is filled after it is memoized.
struct value;
using value_ptr = std::shared_ptr<value>;
struct value {
  enum class kind { none, boolean, integer, real, string, tuple, list, dict, global, tensor, mark } k = kind::none;
  std::int64_t i = 0;
  double f = 0;
  std::string s;                  ///< string, bytes; global: "module.name"
  std::vector<value_ptr> items;   ///< tuple, list; dict: key, value, key, value, ...
  torch::Tensor tensor;
};

value_ptr make(value::kind k) {
  auto v = std::make_shared<value>();
  v->k = k;
  return v;
}

const char* kind_name(value::kind k) {
  switch (k) {
    case value::kind::none: return "None";
    case value::kind::boolean: return "a bool";
    case value::kind::integer: return "an int";
    case value::kind::real: return "a float";
    case value::kind::string: return "a string";
    case value::kind::tuple: return "a tuple";
    case value::kind::list: return "a list";
    case value::kind::dict: return "a dict";
    case value::kind::global: return "a class or function";
    case value::kind::tensor: return "a tensor";
    case value::kind::mark: return "a mark";
  }
  return "?";
}

torch::ScalarType storage_dtype(const std::string& global) {
  static const std::map<std::string, torch::ScalarType> types{
      {"torch.DoubleStorage", torch::kDouble}, {"torch.FloatStorage", torch::kFloat},
      {"torch.HalfStorage", torch::kHalf},     {"torch.BFloat16Storage", torch::kBFloat16},
      {"torch.LongStorage", torch::kLong},     {"torch.IntStorage", torch::kInt},
      {"torch.ShortStorage", torch::kShort},   {"torch.CharStorage", torch::kChar},
      {"torch.ByteStorage", torch::kByte},     {"torch.BoolStorage", torch::kBool},
  };
  auto it = types.find(global);
  if (it == types.end()) fail("storage of unsupported type " + global);
  return it->second;
}

/// The pickle machine (protocols 2 to 5, the opcodes torch.save and LibTorch's pickler use).
class unpickler {
 public:
  unpickler(const std::string& pickle, caffe2::serialize::PyTorchStreamReader& archive)
      : p_(pickle), archive_(archive) {}

  value_ptr run() {
    for (;;) {
      const auto op = std::uint8_t(byte());
      switch (op) {
        case 0x80: byte(); break;           // PROTO
        case 0x95: skip(8); break;          // FRAME
        case '.':                           // STOP
          if (stack_.size() != 1) fail("the pickle ends with " + std::to_string(stack_.size()) + " values");
          return stack_.back();
        case '(': push(make(value::kind::mark)); break;  // MARK
        case '0': pop(); break;                          // POP
        case '1': pop_mark(); break;                     // POP_MARK
        case '2': push(top()); break;                    // DUP
        case 'N': push(make(value::kind::none)); break;
        case 0x88: push(boolean(true)); break;
        case 0x89: push(boolean(false)); break;
        case 'J': push(integer(std::int32_t(le(4)))); break;  // BININT
        case 'K': push(integer(std::int64_t(le(1)))); break;  // BININT1
        case 'M': push(integer(std::int64_t(le(2)))); break;  // BININT2
        case 0x8a: push(integer(long_int(std::size_t(le(1))))); break;  // LONG1
        case 0x8b: push(integer(long_int(std::size_t(le(4))))); break;  // LONG4
        case 'G': {                                                       // BINFLOAT (big-endian)
          std::uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | std::uint8_t(byte());
          auto v = make(value::kind::real);
          std::memcpy(&v->f, &bits, 8);
          push(v);
          break;
        }
        case 'X': push(string(std::size_t(le(4)))); break;  // BINUNICODE
        case 0x8c: push(string(std::size_t(le(1)))); break; // SHORT_BINUNICODE
        case 0x8d: push(string(std::size_t(le(8)))); break; // BINUNICODE8
        case 'T': push(string(std::size_t(le(4)))); break;  // BINSTRING
        case 'U': push(string(std::size_t(le(1)))); break;  // SHORT_BINSTRING
        case 'B': push(string(std::size_t(le(4)))); break;  // BINBYTES
        case 'C': push(string(std::size_t(le(1)))); break;  // SHORT_BINBYTES
        case 0x8e: push(string(std::size_t(le(8)))); break; // BINBYTES8
        case ')': push(make(value::kind::tuple)); break;     // EMPTY_TUPLE
        case 't': push(sequence(value::kind::tuple, pop_mark())); break;
        case 0x85: push(tuple_of(1)); break;
        case 0x86: push(tuple_of(2)); break;
        case 0x87: push(tuple_of(3)); break;
        case ']': push(make(value::kind::list)); break;  // EMPTY_LIST
        case 'l': push(sequence(value::kind::list, pop_mark())); break;
        case 'a': {  // APPEND
          auto v = pop();
          expect(top(), value::kind::list, "APPEND")->items.push_back(v);
          break;
        }
        case 'e': {  // APPENDS
          auto items = pop_mark();
          auto& list = expect(top(), value::kind::list, "APPENDS")->items;
          list.insert(list.end(), items.begin(), items.end());
          break;
        }
        case '}': push(make(value::kind::dict)); break;  // EMPTY_DICT
        case 'd': push(sequence(value::kind::dict, pop_mark())); break;
        case 's': {  // SETITEM
          auto v = pop();
          auto k = pop();
          set_item(top(), k, v);
          break;
        }
        case 'u': {  // SETITEMS
          auto items = pop_mark();
          if (items.size() % 2) fail("SETITEMS with an odd number of values");
          for (std::size_t j = 0; j < items.size(); j += 2) set_item(top(), items[j], items[j + 1]);
          break;
        }
        case 'c': {  // GLOBAL: "module\nname\n"
          auto module = line();
          auto name = line();
          push(global(module + "." + name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          auto name = pop();
          auto module = pop();
          if (module->k != value::kind::string || name->k != value::kind::string) fail("STACK_GLOBAL without names");
          push(global(module->s + "." + name->s));
          break;
        }
        case 'R': {  // REDUCE
          auto args = pop();
          auto callable = pop();
          push(call(callable, args));
          break;
        }
        case 0x81: {  // NEWOBJ
          auto args = pop();
          auto cls = pop();
          push(call(cls, args));
          break;
        }
        case 'b': pop(); break;  // BUILD: an object's state (an OrderedDict's _metadata): not needed
        case 'Q': push(persistent(pop())); break;  // BINPERSID
        case 'q': memo_[le(1)] = top(); break;     // BINPUT
        case 'r': memo_[le(4)] = top(); break;     // LONG_BINPUT
        case 0x94: memo_[memo_.size()] = top(); break;  // MEMOIZE
        case 'h': push(memo(le(1))); break;        // BINGET
        case 'j': push(memo(le(4))); break;        // LONG_BINGET
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", op);
          fail(std::string("unsupported pickle opcode ") + hex + " at byte " + std::to_string(pos_ - 1));
        }
      }
    }
  }

 private:
  char byte() {
    if (pos_ >= p_.size()) fail("the pickle is truncated (it ends at byte " + std::to_string(p_.size()) + ")");
    return p_[pos_++];
  }
  void skip(std::size_t n) {
    if (p_.size() - pos_ < n) fail("the pickle is truncated");
    pos_ += n;
  }
  std::uint64_t le(int n) {
    std::uint64_t v = 0;
    for (int k = 0; k < n; ++k) v |= std::uint64_t(std::uint8_t(byte())) << (8 * k);
    return v;
  }
  std::int64_t long_int(std::size_t n) {
    if (n > 8) fail("an integer of " + std::to_string(n) + " bytes");
    std::uint64_t v = le(int(n));
    if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~std::uint64_t(0) << (8 * n);  // sign-extend
    return std::int64_t(v);
  }
  std::string line() {
    std::string s;
    for (char c; (c = byte()) != '\n';) s += c;
    return s;
  }
  value_ptr string(std::size_t n) {
    if (p_.size() - pos_ < n) fail("the pickle is truncated");
    auto v = make(value::kind::string);
    v->s = p_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  static value_ptr boolean(bool b) {
    auto v = make(value::kind::boolean);
    v->i = b;
    return v;
  }
  static value_ptr integer(std::int64_t i) {
    auto v = make(value::kind::integer);
    v->i = i;
    return v;
  }
  static value_ptr global(const std::string& name) {
    auto v = make(value::kind::global);
    v->s = name;
    return v;
  }
  static value_ptr sequence(value::kind k, std::vector<value_ptr> items) {
    if (k == value::kind::dict && items.size() % 2) fail("DICT with an odd number of values");
    auto v = make(k);
    v->items = std::move(items);
    return v;
  }
  value_ptr tuple_of(std::size_t n) {
    if (stack_.size() < n) fail("the pickle's stack is short");
    std::vector<value_ptr> items(stack_.end() - std::ptrdiff_t(n), stack_.end());
    stack_.resize(stack_.size() - n);
    return sequence(value::kind::tuple, std::move(items));
  }
  static value_ptr expect(const value_ptr& v, value::kind k, const char* op) {
    if (v->k != k) fail(std::string(op) + " on " + kind_name(v->k));
    return v;
  }
  static void set_item(const value_ptr& dict, const value_ptr& k, const value_ptr& v) {
    expect(dict, value::kind::dict, "SETITEM");
    if (k->k == value::kind::string)  // a later value for the same key replaces the earlier
      for (std::size_t j = 0; j < dict->items.size(); j += 2)
        if (dict->items[j]->k == value::kind::string && dict->items[j]->s == k->s) {
          dict->items[j + 1] = v;
          return;
        }
    dict->items.push_back(k);
    dict->items.push_back(v);
  }
  void push(value_ptr v) { stack_.push_back(std::move(v)); }
  value_ptr& top() {
    if (stack_.empty()) fail("the pickle's stack is empty");
    return stack_.back();
  }
  value_ptr pop() {
    auto v = top();
    stack_.pop_back();
    if (v->k == value::kind::mark) fail("the pickle pops a mark");
    return v;
  }
  std::vector<value_ptr> pop_mark() {
    for (std::size_t j = stack_.size(); j-- > 0;)
      if (stack_[j]->k == value::kind::mark) {
        std::vector<value_ptr> items(stack_.begin() + std::ptrdiff_t(j) + 1, stack_.end());
        stack_.resize(j);
        return items;
      }
    fail("the pickle has no mark to pop to");
  }
  value_ptr memo(std::uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) fail("the pickle reads memo entry " + std::to_string(key) + ", never written");
    return it->second;
  }

  static std::vector<std::int64_t> ints(const value_ptr& v, const char* what) {
    if (v->k != value::kind::tuple && v->k != value::kind::list) fail(std::string(what) + " is not a tuple");
    std::vector<std::int64_t> out;
    for (const auto& x : v->items) {
      if (x->k != value::kind::integer) fail(std::string(what) + " holds " + kind_name(x->k));
      out.push_back(x->i);
    }
    return out;
  }

  /// A tensor storage: ('storage', storage type, key, location, numel) -> data/<key>.
  value_ptr persistent(const value_ptr& id) {
    if (id->k != value::kind::tuple || id->items.size() < 5 || id->items[0]->k != value::kind::string ||
        id->items[0]->s != "storage" || id->items[1]->k != value::kind::global ||
        id->items[2]->k != value::kind::string || id->items[4]->k != value::kind::integer)
      fail("a persistent object that is not a tensor storage");
    const auto dtype = storage_dtype(id->items[1]->s);
    const std::string& key = id->items[2]->s;
    const std::int64_t numel = id->items[4]->i;
    auto it = storages_.find(key);
    if (it == storages_.end()) {
      const std::string record = "data/" + key;
      if (!archive_.hasRecord(record)) fail("the archive has no record " + record + " for a tensor storage");
      auto [data, size] = archive_.getRecord(record);
      const auto item = std::int64_t(c10::elementSize(dtype));
      if (numel < 0 || std::int64_t(size) < numel * item)
        fail("storage " + key + " holds " + std::to_string(size) + " bytes, short of " + std::to_string(numel) +
             " elements of " + c10::toString(dtype));
      auto t = torch::empty({numel}, torch::TensorOptions().dtype(dtype));
      if (numel > 0) std::memcpy(t.data_ptr(), data.get(), std::size_t(numel * item));
      it = storages_.emplace(key, t).first;
    }
    auto v = make(value::kind::tensor);
    v->tensor = it->second;  // the whole storage: _rebuild_tensor takes its view
    return v;
  }

  /// REDUCE / NEWOBJ: only what a state_dict holds.
  value_ptr call(const value_ptr& callable, const value_ptr& args) {
    if (callable->k != value::kind::global) fail(std::string("a call of ") + kind_name(callable->k));
    const std::string& f = callable->s;
    if (args->k != value::kind::tuple) fail(f + " called without a tuple of arguments");
    const auto& a = args->items;
    if (f == "collections.OrderedDict" || f == "builtins.dict" || f == "__builtin__.dict") {
      auto d = make(value::kind::dict);
      if (!a.empty() && (a[0]->k == value::kind::list || a[0]->k == value::kind::tuple))
        for (const auto& pair : a[0]->items) {  // OrderedDict([(key, value), ...])
          if ((pair->k != value::kind::tuple && pair->k != value::kind::list) || pair->items.size() != 2)
            fail(f + " of something other than pairs");
          set_item(d, pair->items[0], pair->items[1]);
        }
      return d;
    }
    if (f == "torch._utils._rebuild_tensor_v2" || f == "torch._utils._rebuild_tensor") {
      if (a.size() < 4 || a[0]->k != value::kind::tensor || a[1]->k != value::kind::integer)
        fail(f + " with unexpected arguments");
      const auto& storage = a[0]->tensor;
      const auto size = ints(a[2], "a tensor's size"), stride = ints(a[3], "a tensor's stride");
      if (size.size() != stride.size()) fail("a tensor whose size and stride differ in length");
      const std::int64_t offset = a[1]->i;
      std::int64_t last = offset;  // the last element the view reaches
      bool empty = false;
      for (std::size_t j = 0; j < size.size(); ++j) {
        if (size[j] < 0 || stride[j] < 0) fail("a tensor with a negative size or stride");
        if (size[j] == 0) empty = true;
        else last += (size[j] - 1) * stride[j];
      }
      if (offset < 0 || (!empty && last >= storage.numel()))
        fail("a tensor reaches past its storage (" + std::to_string(storage.numel()) + " elements)");
      auto v = make(value::kind::tensor);
      v->tensor = empty ? torch::empty(size, storage.options()) : storage.as_strided(size, stride, offset);
      return v;
    }
    if (f == "torch._utils._rebuild_parameter" || f == "torch._utils._rebuild_parameter_with_state") {
      if (a.empty() || a[0]->k != value::kind::tensor) fail(f + " without a tensor");
      return a[0];
    }
    fail("an object of " + f + ", which a state_dict does not hold");
  }

  const std::string& p_;
  std::size_t pos_ = 0;
  caffe2::serialize::PyTorchStreamReader& archive_;
  std::vector<value_ptr> stack_;
  std::map<std::uint64_t, value_ptr> memo_;
  std::map<std::string, torch::Tensor> storages_;
};

}  // namespace

named_tensors read_torch_state_dict(const std::vector<char>& bytes) {
  static const char legacy_magic[] = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";
  if (bytes.size() >= 14 && std::memcmp(bytes.data(), legacy_magic, 14) == 0)
    fail("it is in torch.save's legacy format (before PyTorch 1.6, or _use_new_zipfile_serialization=False): "
         "save it again with a newer torch.save");
  if (bytes.size() < 4 || std::memcmp(bytes.data(), "PK\x03\x04", 4) != 0)
    fail("it is not a zip archive, as torch.save writes");
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  try {
    archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(std::make_shared<bytes_adapter>(bytes));
  } catch (const std::exception& e) {
    std::string msg = e.what();
    fail("its zip archive does not read (" + msg.substr(0, msg.find('\n')) + ")");
  }
  if (archive->hasRecord("byteorder")) {
    auto [data, size] = archive->getRecord("byteorder");
    const std::string order(static_cast<const char*>(data.get()), size);
    if (order.rfind("little", 0) != 0) fail("its tensors are stored " + order + "-endian");
  }
  if (archive->hasRecord("constants.pkl"))
    fail("it is a TorchScript module (torch.jit.save), not a state_dict: save model.state_dict() with torch.save");
  if (!archive->hasRecord("data.pkl")) fail("its archive has no data.pkl");
  auto [data, size] = archive->getRecord("data.pkl");
  const std::string pickle(static_cast<const char*>(data.get()), size);
  const auto top = unpickler(pickle, *archive).run();
  if (top->k != value::kind::dict) fail(std::string("it holds ") + kind_name(top->k) + ", not a state_dict (a dict of tensors)");
  named_tensors out;
  for (std::size_t j = 0; j < top->items.size(); j += 2) {
    const auto& k = top->items[j];
    const auto& v = top->items[j + 1];
    if (k->k != value::kind::string) fail(std::string("it holds a key that is ") + kind_name(k->k) + ", not a name");
    if (v->k != value::kind::tensor) {
      std::string hint;
      if (v->k == value::kind::dict) hint = " (a dict: is the state_dict inside, as in torch.save({'" + k->s + "': model.state_dict()})?)";
      fail("its entry '" + k->s + "' is " + kind_name(v->k) + ", not a tensor" + hint);
    }
    out.emplace_back(k->s, v->tensor.contiguous().clone());
  }
  return out;
}

std::string read_torch_file_record(const std::string& path, const std::string& name) {
  try {
    caffe2::serialize::PyTorchStreamReader archive(path);
    if (!archive.hasRecord(name)) return "";
    auto [data, size] = archive.getRecord(name);
    return std::string(static_cast<const char*>(data.get()), size);
  } catch (const std::exception&) {  // (no zip archive: torch.save's legacy format, or no file)
    return "";
  }
}

std::string read_torch_record(const std::vector<char>& bytes, const std::string& name) {
  if (bytes.size() < 4 || std::memcmp(bytes.data(), "PK\x03\x04", 4) != 0) return "";
  try {
    caffe2::serialize::PyTorchStreamReader archive(std::make_shared<bytes_adapter>(bytes));
    if (!archive.hasRecord(name)) return "";
    auto [data, size] = archive.getRecord(name);
    return std::string(static_cast<const char*>(data.get()), size);
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace troupe
