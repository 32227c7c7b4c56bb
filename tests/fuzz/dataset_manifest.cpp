// A dataset's manifest.json (any format version), as read_manifest parses and checks it.
#include <string>

#include "data/manifest.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  loom::fuzz::refuses_cleanly([&] {
    const loom::data::Manifest m = loom::data::format::parse_manifest_text(text, "fuzz.json");
    (void)loom::data::format::content_version(m);
    (void)m.total_items();
  });
  return 0;
}
