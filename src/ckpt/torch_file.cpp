// Reading and writing torch.save files (see torch_file.h). The reader is a small pickle
// machine for the opcodes of protocol 2 that torch.save emits for a dict of tensors.
#include "ckpt/torch_file.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>

#include "loom/error.h"
#include "util/dtype.h"
#include "util/files.h"

namespace loom::ckpt {
namespace {

namespace fs = std::filesystem;

// A pickled value. Shared, because the memo and the stack refer to the same object (a dict is
// memoized before SETITEMS fills it).
struct Value;
using Ref = std::shared_ptr<Value>;
struct Value {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kTuple,
    kList,
    kDict,
    kGlobal,
    kTensor,
    kStorage,
    kMark
  };
  Kind kind = Kind::kNone;
  int64_t integer = 0;
  double real = 0;
  std::string text;                          // kString; kGlobal: "module.name"
  std::vector<Ref> items;                    // kTuple, kList
  std::vector<std::pair<Ref, Ref>> entries;  // kDict, in insertion order
  at::Tensor tensor;                         // kTensor; kStorage: 1-D, the storage's elements
};

Ref make(Value::Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}

struct StorageType {
  const char* name;
  c10::ScalarType type;
};
constexpr StorageType kStorageTypes[] = {
    {"torch.FloatStorage", at::kFloat}, {"torch.DoubleStorage", at::kDouble},
    {"torch.HalfStorage", at::kHalf},   {"torch.BFloat16Storage", at::kBFloat16},
    {"torch.LongStorage", at::kLong},   {"torch.IntStorage", at::kInt},
    {"torch.ShortStorage", at::kShort}, {"torch.CharStorage", at::kChar},
    {"torch.ByteStorage", at::kByte},   {"torch.BoolStorage", at::kBool},
};

class Unpickler {
 public:
  Unpickler(const fs::path& path, caffe2::serialize::PyTorchStreamReader& zip, std::string pickle)
      : path_(path), zip_(zip), pickle_(std::move(pickle)) {}

  Ref run() {
    for (;;) {
      const auto op = static_cast<unsigned char>(byte());
      if (op == '.') break;  // STOP
      step(op);
    }
    LOOM_CHECK(stack_.size() == 1, CorruptData, what(), ": the pickle ends with ", stack_.size(),
               " values on its stack, expected 1");
    return stack_.back();
  }

 private:
  std::string what() const { return "torch file " + path_.string(); }

  CorruptData bad(const std::string& why) const { return CorruptData(what() + ": " + why); }

  char byte() {
    if (pos_ >= pickle_.size()) throw bad("data.pkl ends early (truncated)");
    return pickle_[pos_++];
  }
  std::string bytes(size_t n) {
    if (n > pickle_.size() - pos_) throw bad("data.pkl ends early (truncated)");
    std::string s = pickle_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  uint64_t little(size_t n) {
    const std::string s = bytes(n);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t{static_cast<unsigned char>(s[i])} << (8 * i);
    return v;
  }
  std::string line() {
    const size_t end = pickle_.find('\n', pos_);
    if (end == std::string::npos) throw bad("data.pkl ends early (truncated)");
    std::string s = pickle_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }

  Ref pop() {
    if (stack_.empty()) throw bad("the pickle pops an empty stack");
    Ref v = stack_.back();
    stack_.pop_back();
    return v;
  }
  // The values above the topmost mark, which is removed.
  std::vector<Ref> pop_to_mark() {
    std::vector<Ref> items;
    for (;;) {
      Ref v = pop();
      if (v->kind == Value::Kind::kMark) break;
      items.insert(items.begin(), v);
    }
    return items;
  }
  Ref& top() {
    if (stack_.empty()) throw bad("the pickle reads an empty stack");
    return stack_.back();
  }
  void push_int(int64_t v) {
    Ref r = make(Value::Kind::kInt);
    r->integer = v;
    stack_.push_back(r);
  }
  Ref tuple(std::vector<Ref> items) {
    Ref t = make(Value::Kind::kTuple);
    t->items = std::move(items);
    return t;
  }
  void memo_put(uint64_t key) { memo_[key] = top(); }
  Ref memo_get(uint64_t key) {
    const auto it = memo_.find(key);
    if (it == memo_.end())
      throw bad("the pickle refers to memo entry " + std::to_string(key) + " before defining it");
    return it->second;
  }

  void step(unsigned char op) {
    switch (op) {
      case 0x80:
        byte();
        break;  // PROTO
      case '(':
        stack_.push_back(make(Value::Kind::kMark));
        break;
      case 'N':
        stack_.push_back(make(Value::Kind::kNone));
        break;
      case 0x88:
      case 0x89: {
        Ref b = make(Value::Kind::kBool);
        b->integer = op == 0x88;
        stack_.push_back(b);
        break;
      }
      case 'K':
        push_int(static_cast<unsigned char>(byte()));
        break;  // BININT1
      case 'M':
        push_int(static_cast<int64_t>(little(2)));
        break;  // BININT2
      case 'J':
        push_int(static_cast<int32_t>(little(4)));
        break;      // BININT
      case 0x8a: {  // LONG1
        const size_t n = static_cast<unsigned char>(byte());
        if (n > 8) throw bad("an integer of " + std::to_string(n) + " bytes");
        uint64_t v = n ? little(n) : 0;
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);
        push_int(static_cast<int64_t>(v));
        break;
      }
      case 'G': {  // BINFLOAT, big-endian
        std::string s = bytes(8);
        std::reverse(s.begin(), s.end());
        Ref f = make(Value::Kind::kFloat);
        std::memcpy(&f->real, s.data(), 8);
        stack_.push_back(f);
        break;
      }
      case 'X':    // BINUNICODE
      case 'T':    // BINSTRING
      case 'U': {  // SHORT_BINSTRING
        const uint64_t n = op == 'U' ? static_cast<unsigned char>(byte()) : little(4);
        Ref s = make(Value::Kind::kString);
        s->text = bytes(n);
        stack_.push_back(s);
        break;
      }
      case 'c': {  // GLOBAL
        Ref g = make(Value::Kind::kGlobal);
        const std::string module = line();
        g->text = module + "." + line();
        stack_.push_back(g);
        break;
      }
      case 'q':
        memo_put(static_cast<unsigned char>(byte()));
        break;  // BINPUT
      case 'r':
        memo_put(little(4));
        break;  // LONG_BINPUT
      case 'h':
        stack_.push_back(memo_get(static_cast<unsigned char>(byte())));
        break;
      case 'j':
        stack_.push_back(memo_get(little(4)));
        break;
      case ')':
        stack_.push_back(tuple({}));
        break;
      case 't':
        stack_.push_back(tuple(pop_to_mark()));
        break;
      case 0x85:
      case 0x86:
      case 0x87: {
        std::vector<Ref> items(op - 0x84);
        for (size_t i = items.size(); i-- > 0;) items[i] = pop();
        stack_.push_back(tuple(std::move(items)));
        break;
      }
      case '}':
        stack_.push_back(make(Value::Kind::kDict));
        break;
      case ']':
        stack_.push_back(make(Value::Kind::kList));
        break;
      case 'u':
      case 's': {  // SETITEMS, SETITEM
        std::vector<Ref> items;
        if (op == 'u') {
          items = pop_to_mark();
        } else {
          Ref v = pop();
          items = {pop(), v};
        }
        Ref& dict = top();
        if (dict->kind != Value::Kind::kDict || items.size() % 2 != 0)
          throw bad("the pickle sets items on something that is not a dict");
        for (size_t i = 0; i < items.size(); i += 2)
          dict->entries.emplace_back(items[i], items[i + 1]);
        break;
      }
      case 'e':
      case 'a': {  // APPENDS, APPEND
        std::vector<Ref> items = op == 'e' ? pop_to_mark() : std::vector<Ref>{pop()};
        Ref& list = top();
        if (list->kind != Value::Kind::kList) throw bad("the pickle appends to a non-list");
        for (Ref& v : items) list->items.push_back(v);
        break;
      }
      case 'b':
        pop();
        break;  // BUILD: an OrderedDict's state (_metadata): dropped
      case 'Q':
        stack_.push_back(storage(pop()));
        break;     // BINPERSID
      case 'R': {  // REDUCE
        Ref args = pop();
        Ref callable = pop();
        stack_.push_back(reduce(*callable, *args));
        break;
      }
      default: {
        char hexop[8];
        std::snprintf(hexop, sizeof hexop, "0x%02x", op);
        throw bad(detail::concat("pickle opcode ", hexop, " at byte ", pos_ - 1,
                                 " is not one torch.save writes for a dict of tensors (save a "
                                 "state_dict() with the default pickle protocol)"));
      }
    }
  }

  // ('storage', torch.<T>Storage, key, location, numel) -> the record data/<key> as a tensor.
  Ref storage(const Ref& pid) {
    const auto& f = pid->items;
    if (pid->kind != Value::Kind::kTuple || f.size() != 5 || f[0]->text != "storage" ||
        f[1]->kind != Value::Kind::kGlobal || f[2]->kind != Value::Kind::kString ||
        f[4]->kind != Value::Kind::kInt)
      throw bad("a persistent id that is not a torch storage");
    auto cached = storages_.find(f[2]->text);
    if (cached != storages_.end()) return cached->second;
    c10::ScalarType type = c10::ScalarType::Undefined;
    for (const auto& s : kStorageTypes)
      if (f[1]->text == s.name) type = s.type;
    if (type == c10::ScalarType::Undefined)
      throw bad("storage type " + f[1]->text + " is not one Loom reads");
    const std::string record = "data/" + f[2]->text;
    if (!zip_.hasRecord(record)) throw bad("the archive has no record " + record);
    auto [data, size] = zip_.getRecord(record);
    const int64_t numel = f[4]->integer;
    const size_t es = c10::elementSize(type);
    if (numel < 0 || static_cast<uint64_t>(numel) > size / es)
      throw bad(detail::concat("record ", record, " holds ", size, " bytes, fewer than its ", numel,
                               " elements of ", util::dtype_name(type)));
    Ref s = make(Value::Kind::kStorage);
    s->tensor = at::empty({numel}, at::TensorOptions().dtype(type));
    if (numel > 0) std::memcpy(s->tensor.data_ptr(), data.get(), numel * es);
    storages_[f[2]->text] = s;
    return s;
  }

  std::vector<int64_t> ints(const Ref& t, const char* what_) {
    std::vector<int64_t> out;
    if (t->kind != Value::Kind::kTuple) throw bad(std::string(what_) + " is not a tuple");
    for (const Ref& v : t->items) {
      if (v->kind != Value::Kind::kInt) throw bad(std::string(what_) + " has a non-integer");
      out.push_back(v->integer);
    }
    return out;
  }

  Ref reduce(const Value& callable, const Value& args) {
    if (callable.kind != Value::Kind::kGlobal || args.kind != Value::Kind::kTuple)
      throw bad("the pickle calls something that is not a global");
    const auto& a = args.items;
    if (callable.text == "collections.OrderedDict" && a.empty()) return make(Value::Kind::kDict);
    if (callable.text == "torch._utils._rebuild_tensor_v2" && a.size() >= 4 &&
        a[0]->kind == Value::Kind::kStorage && a[1]->kind == Value::Kind::kInt) {
      const at::Tensor& storage = a[0]->tensor;
      const std::vector<int64_t> size = ints(a[2], "a tensor's size"),
                                 stride = ints(a[3], "a tensor's stride");
      if (size.size() != stride.size()) throw bad("a tensor's size and stride differ in length");
      int64_t last = a[1]->integer;  // the largest element index the view reaches
      for (size_t i = 0; i < size.size(); ++i) {
        if (size[i] < 0 || stride[i] < 0) throw bad("a tensor has a negative size or stride");
        if (size[i] == 0) last = -1;
        if (last >= 0) last += (size[i] - 1) * stride[i];
      }
      if (a[1]->integer < 0 || last >= storage.numel())
        throw bad("a tensor reaches outside its storage of " + std::to_string(storage.numel()) +
                  " elements");
      Ref t = make(Value::Kind::kTensor);
      t->tensor = storage.as_strided(size, stride, a[1]->integer).contiguous();
      return t;
    }
    if (callable.text == "torch._utils._rebuild_parameter" && !a.empty() &&
        a[0]->kind == Value::Kind::kTensor)
      return a[0];
    throw bad("the pickle builds a " + callable.text +
              ", which is not part of a dict of tensors (save a state_dict())");
  }

  const fs::path& path_;
  caffe2::serialize::PyTorchStreamReader& zip_;
  std::string pickle_;
  size_t pos_ = 0;
  std::vector<Ref> stack_;
  std::map<uint64_t, Ref> memo_;
  std::map<std::string, Ref> storages_;
};

}  // namespace

void write_torch_file(const fs::path& path, const std::vector<NamedTensor>& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const NamedTensor& t : tensors) {
    LOOM_CHECK(!dict.contains(t.name), InvalidArgument, "tensor name \"", t.name,
               "\" is used twice");
    dict.insert(t.name, t.tensor.contiguous().cpu());
  }
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  util::write_file_atomic(path, std::string(bytes.begin(), bytes.end()));
}

std::vector<NamedTensor> read_torch_file(const fs::path& path) {
  const std::string what = "torch file " + path.string();
  LOOM_CHECK(fs::is_regular_file(path), IoError, "no file ", path.string());
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  std::string pickle;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path.string());
    LOOM_CHECK(zip->hasRecord("data.pkl"), CorruptData, what,
               " has no data.pkl: not a torch.save archive");
    auto [data, size] = zip->getRecord("data.pkl");
    pickle.assign(static_cast<const char*>(data.get()), size);
  } catch (const c10::Error& e) {
    throw CorruptData(detail::concat(what, " is not a torch.save zip archive (",
                                     e.what_without_backtrace(),
                                     "); files from torch.save(..., "
                                     "_use_new_zipfile_serialization=False) are not read"));
  }
  Ref root;
  try {
    root = Unpickler(path, *zip, std::move(pickle)).run();
  } catch (const c10::Error& e) {
    throw CorruptData(detail::concat(what, ": ", e.what_without_backtrace()));
  }
  LOOM_CHECK(root->kind == Value::Kind::kDict, CorruptData, what,
             " does not hold a dict (save a state_dict(), a dict of tensors)");
  std::vector<NamedTensor> tensors;
  for (const auto& [key, value] : root->entries) {
    LOOM_CHECK(key->kind == Value::Kind::kString, CorruptData, what,
               ": a key of its dict is not a string");
    LOOM_CHECK(value->kind == Value::Kind::kTensor, CorruptData, what, ": entry \"", key->text,
               "\" is not a tensor (save a state_dict() of tensors, not a dict of dicts)");
    tensors.push_back({key->text, value->tensor});
  }
  return tensors;
}

}  // namespace loom::ckpt
