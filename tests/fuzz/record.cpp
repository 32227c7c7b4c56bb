// A record's payload as stored in a record shard, decoded against a schema with every field
// type (the reader checks each record's xxHash64 first, so this is what a hash collision or a
// writer bug would hand the decoder).
#include <string>
#include <vector>

#include "data/shard_format.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using loom::data::Field;
  using loom::data::FieldType;
  static const std::vector<Field> schema = {
      {.name = "image", .type = FieldType::kTensor, .dtype = "uint8", .shape = {2, 3}},
      {.name = "label", .type = FieldType::kInt},
      {.name = "caption", .type = FieldType::kText},
      {.name = "weight", .type = FieldType::kFloat},
      {.name = "raw", .type = FieldType::kBytes},
      {.name = "ragged", .type = FieldType::kTensor, .dtype = "float32", .ragged = true},
      {.name = "photo", .type = FieldType::kImage},
      {.name = "album", .type = FieldType::kImages},
  };
  loom::data::format::FieldView views[8];
  const std::string problem = loom::data::format::decode_record(schema, data, size, views);
  if (problem.empty()) {
    // A record that decodes is one whose every view lies inside the payload.
    for (const auto& v : views) {
      if (v.data != nullptr && (v.data < data || v.data + v.size > data + size)) __builtin_trap();
    }
    // And so is every image of a list.
    for (const auto& [p, n] : loom::data::format::list_items(views[7])) {
      if (p < data || p + n > data + size) __builtin_trap();
    }
  }
  return 0;
}
