#include "util/dtype.h"

namespace loom::util {
namespace {

struct Entry {
  c10::ScalarType type;
  const char* name;
};

constexpr Entry kTable[] = {
    {c10::ScalarType::Byte, "uint8"},
    {c10::ScalarType::Char, "int8"},
    {c10::ScalarType::Short, "int16"},
    {c10::ScalarType::Int, "int32"},
    {c10::ScalarType::Long, "int64"},
    {c10::ScalarType::Half, "float16"},
    {c10::ScalarType::BFloat16, "bfloat16"},
    {c10::ScalarType::Float, "float32"},
    {c10::ScalarType::Double, "float64"},
    {c10::ScalarType::Bool, "bool"},
    {c10::ScalarType::ComplexFloat, "complex64"},
    {c10::ScalarType::ComplexDouble, "complex128"},
};

}  // namespace

std::string dtype_name(c10::ScalarType type) {
  for (const Entry& e : kTable) {
    if (e.type == type) return e.name;
  }
  return c10::toString(type);
}

std::optional<c10::ScalarType> dtype_of(std::string_view name) {
  for (const Entry& e : kTable) {
    if (name == e.name) return e.type;
  }
  return std::nullopt;
}

bool is_named_dtype(c10::ScalarType type) {
  for (const Entry& e : kTable) {
    if (e.type == type) return true;
  }
  return false;
}

const std::string& dtype_names() {
  static const std::string names = [] {
    std::string out;
    const size_t n = sizeof(kTable) / sizeof(kTable[0]);
    for (size_t i = 0; i < n; ++i) {
      out += (i == 0 ? "" : i + 1 == n ? " or " : ", ");
      out += kTable[i].name;
    }
    return out;
  }();
  return names;
}

}  // namespace loom::util
