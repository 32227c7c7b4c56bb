// The bytes of weight snapshots: layouts, segment headers, the TCP protocol's lines and their
// checks (see weights_format.h).
#include "control/weights_format.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "loom/error.h"
#include "util/dtype.h"
#include "util/json.h"

namespace loom::control::weights {
namespace {

using nlohmann::json;

constexpr int64_t kMaxDim = int64_t{1} << 48;
constexpr int64_t kMaxTimeoutMs = 10 * 60 * 1000;
constexpr size_t kCopyChunk = 256 * 1024;

std::string describe(const TensorSpec& t) {
  std::ostringstream out;
  out << util::dtype_name(t.dtype) << " [";
  for (size_t i = 0; i < t.shape.size(); ++i) out << (i ? ", " : "") << t.shape[i];
  out << "]";
  return out.str();
}

const json& field(const json& object, const char* key, const std::string& where) {
  const auto it = object.find(key);
  LOOM_CHECK(it != object.end(), CorruptData, where, ": \"", key, "\" is missing");
  return *it;
}

std::string string_field(const json& object, const char* key, const std::string& where) {
  const json& value = field(object, key, where);
  LOOM_CHECK(value.is_string(), CorruptData, where, ": \"", key, "\" is ", value.dump(),
             ", not a string");
  return value.get<std::string>();
}

}  // namespace

bool TensorSpec::operator==(const TensorSpec& other) const {
  return name == other.name && dtype == other.dtype && shape == other.shape &&
         offset == other.offset && bytes == other.bytes;
}

Layout layout_of(const std::map<std::string, at::Tensor>& tensors) {
  Layout layout;
  for (const auto& [name, tensor] : tensors) {
    LOOM_CHECK(tensor.defined(), InvalidArgument, "weights: tensor \"", name,
               "\" is undefined: publish defined tensors only");
    LOOM_CHECK(util::is_named_dtype(tensor.scalar_type()), InvalidArgument, "weights: tensor \"",
               name, "\" has dtype ", util::dtype_name(tensor.scalar_type()),
               ", which weight snapshots cannot carry; use one of ", util::dtype_names());
    TensorSpec spec;
    spec.name = name;
    spec.dtype = tensor.scalar_type();
    spec.shape = tensor.sizes().vec();
    spec.offset = layout.total_bytes;
    spec.bytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
    layout.total_bytes += spec.bytes;
    layout.tensors.push_back(std::move(spec));
  }
  return layout;
}

std::string layout_difference(const Layout& published, const Layout& given) {
  std::map<std::string, const TensorSpec*> by_name;
  for (const TensorSpec& t : published.tensors) by_name[t.name] = &t;
  for (const TensorSpec& t : given.tensors) {
    const auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      return detail::concat("tensor \"", t.name,
                            "\" is not in the published layout (fixed by the first publish)");
    }
    if (it->second->dtype != t.dtype || it->second->shape != t.shape) {
      return detail::concat("tensor \"", t.name, "\" is ", describe(*it->second),
                            " in the published layout and ", describe(t), " here");
    }
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return detail::concat("tensor \"", by_name.begin()->first,
                          "\" of the published layout is missing");
  }
  return "";
}

json layout_json(const Layout& layout) {
  json tensors = json::array();
  for (const TensorSpec& t : layout.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", util::dtype_name(t.dtype)},
                       {"shape", t.shape},
                       {"offset", t.offset},
                       {"bytes", t.bytes}});
  }
  return tensors;
}

Layout parse_layout(const json& value, const std::string& where) {
  LOOM_CHECK(value.is_array(), CorruptData, where, ": the layout is not a JSON array");
  Layout layout;
  for (size_t i = 0; i < value.size(); ++i) {
    const json& entry = value[i];
    const std::string at = detail::concat(where, ": layout entry ", i);
    LOOM_CHECK(entry.is_object(), CorruptData, at, " is not an object");
    TensorSpec t;
    t.name = string_field(entry, "name", at);
    LOOM_CHECK(!t.name.empty(), CorruptData, at, " has an empty name");
    LOOM_CHECK(layout.tensors.empty() || layout.tensors.back().name < t.name, CorruptData, at,
               " (\"", t.name, "\") is not after \"",
               layout.tensors.empty() ? "" : layout.tensors.back().name,
               "\": names must be unique and in order");
    const std::string dtype = string_field(entry, "dtype", at);
    const auto type = util::dtype_of(dtype);
    LOOM_CHECK(type.has_value(), CorruptData, at, " (\"", t.name, "\") has dtype \"", dtype,
               "\", not one of ", util::dtype_names());
    t.dtype = *type;
    const json& shape = field(entry, "shape", at);
    LOOM_CHECK(shape.is_array() && shape.size() <= kMaxDims, CorruptData, at, " (\"", t.name,
               "\"): shape ", shape.dump(), " is not an array of at most ", kMaxDims, " sizes");
    const uint64_t element = c10::elementSize(t.dtype);
    uint64_t elements = 1;
    for (const json& dim : shape) {
      const auto d = util::integer_field<int64_t>(dim, "shape", at);
      LOOM_CHECK(d >= 0 && d <= kMaxDim, CorruptData, at, " (\"", t.name, "\"): size ", d,
                 " is outside [0, 2^48]");
      // Bounded before multiplying: elements * d * element stays below 2^64.
      LOOM_CHECK(d == 0 || elements <= kMaxDataBytes / element / static_cast<uint64_t>(d),
                 CorruptData, at, " (\"", t.name, "\"): shape ", shape.dump(),
                 " holds more than 2^46 bytes");
      elements *= static_cast<uint64_t>(d);
      t.shape.push_back(d);
    }
    t.offset = util::integer_field<uint64_t>(field(entry, "offset", at), "offset", at);
    t.bytes = util::integer_field<uint64_t>(field(entry, "bytes", at), "bytes", at);
    LOOM_CHECK(t.bytes == elements * element, CorruptData, at, " (\"", t.name, "\"): ", t.bytes,
               " bytes, but ", describe(t), " has ", elements * element);
    LOOM_CHECK(t.offset == layout.total_bytes, CorruptData, at, " (\"", t.name, "\"): offset ",
               t.offset, " where the tensors before it end at ", layout.total_bytes);
    LOOM_CHECK(t.bytes <= kMaxDataBytes - layout.total_bytes, CorruptData, where,
               ": the tensors hold more than 2^46 bytes");
    layout.total_bytes += t.bytes;
    layout.tensors.push_back(std::move(t));
  }
  return layout;
}

Geometry geometry(int slots, uint64_t layout_bytes, uint64_t data_bytes) {
  Geometry g;
  g.layout_offset = kHeaderRegion;
  g.data_offset = round_up(g.layout_offset + layout_bytes, kPage);
  g.slot_stride = round_up(data_bytes, kPage);
  g.segment_bytes = g.data_offset + static_cast<uint64_t>(slots) * g.slot_stride;
  return g;
}

void check_header(const SegmentHeader& h, uint64_t file_bytes, const std::string& where) {
  const uint64_t magic = h.magic.load(std::memory_order_acquire);
  LOOM_CHECK(magic == kMagic, CorruptData, where, " is not a Loom weights segment (magic ",
             std::hex, magic, std::dec, ")");
  LOOM_CHECK(h.format_version == kFormatVersion, CorruptData, where, " has format version ",
             h.format_version, "; this Loom reads version ", kFormatVersion,
             ": publisher and subscriber must run the same Loom release");
  LOOM_CHECK(h.slot_count >= static_cast<uint32_t>(kMinSlots) &&
                 h.slot_count <= static_cast<uint32_t>(kMaxSlots),
             CorruptData, where, ": slot count ", h.slot_count, " is outside [", kMinSlots, ", ",
             kMaxSlots, "]");
  LOOM_CHECK(h.layout_bytes <= kMaxLayoutBytes && h.data_bytes <= kMaxDataBytes, CorruptData, where,
             ": layout of ", h.layout_bytes, " bytes or versions of ", h.data_bytes,
             " bytes beyond the limits");
  const Geometry g = geometry(static_cast<int>(h.slot_count), h.layout_bytes, h.data_bytes);
  LOOM_CHECK(h.layout_offset == g.layout_offset && h.data_offset == g.data_offset &&
                 h.slot_stride == g.slot_stride && h.segment_bytes == g.segment_bytes,
             CorruptData, where, ": the header's offsets do not match its sizes");
  LOOM_CHECK(h.segment_bytes == file_bytes, CorruptData, where, " has ", file_bytes,
             " bytes where its header says ", h.segment_bytes);
}

std::string segment_name(const std::string& name) { return kSegmentPrefix + name; }
std::string segment_path(const std::string& name) { return "/dev/shm/" + segment_name(name); }

void check_name(const std::string& name) {
  const bool chars_ok = std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
  LOOM_CHECK(!name.empty() && name.size() <= 200 && chars_ok && name[0] != '.', InvalidArgument,
             "weights name \"", name,
             "\" must be 1 to 200 characters of [A-Za-z0-9._-], not starting with '.' (it names "
             "the segment /dev/shm/",
             kSegmentPrefix, "<name>); a TCP source is \"HOST:PORT\"");
}

#if defined(__SANITIZE_THREAD__)
// TSan models neither fences (GCC refuses them under -fsanitize=thread) nor seqlocks, whose
// reader copies bytes the writer may be rewriting by design. In that build the reader's copy is
// a volatile byte loop in a function TSan does not instrument, and a compiler barrier stands for
// each fence (acquire and release fences are no instructions on x86 anyway).
static __attribute__((no_sanitize_thread)) void copy_bytes(uint8_t* out, const uint8_t* in,
                                                           size_t n) {
  const volatile uint8_t* from = in;
  for (size_t i = 0; i < n; ++i) out[i] = from[i];
}
static void fence(std::memory_order) { std::atomic_signal_fence(std::memory_order_seq_cst); }
#else
static void copy_bytes(uint8_t* out, const uint8_t* in, size_t n) { std::memcpy(out, in, n); }
static void fence(std::memory_order order) { std::atomic_thread_fence(order); }
#endif

void copy_and_hash(void* dst, const void* src, size_t n, util::Hasher64& hasher) {
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  for (size_t done = 0; done < n; done += kCopyChunk) {
    const size_t length = std::min(kCopyChunk, n - done);
    copy_bytes(out + done, in + done, length);
    hasher.update(out + done, length);
  }
}

// The sequence lock follows Boehm, "Can seqlocks get along with programming language memory
// models?" (2012): the writer's release fence after making seq odd, the reader's acquire fence
// before loading seq again. The bytes themselves are copied with memcpy, as every seqlock does;
// a copy that raced the writer is never used (seq differs) and the checksum is checked anyway.
void begin_write(SegmentHeader& header, int slot) {
  SlotHeader& s = header.slots[slot];
  s.seq.store(s.seq.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  fence(std::memory_order_release);
}

void end_write(SegmentHeader& header, int slot, int64_t version, uint64_t checksum) {
  SlotHeader& s = header.slots[slot];
  s.version.store(version, std::memory_order_relaxed);
  s.checksum.store(checksum, std::memory_order_relaxed);
  s.seq.store(s.seq.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  header.latest_version.store(version, std::memory_order_relaxed);
  header.latest_slot.store(slot, std::memory_order_release);
  header.publishes.fetch_add(1, std::memory_order_release);
}

ReadResult read_newest(const SegmentHeader& header, const uint8_t* base, int64_t newer_than,
                       const std::vector<Span>& spans, const std::string& where,
                       const std::function<void()>& during_copy) {
  ReadResult result;
  const int32_t slot = header.latest_slot.load(std::memory_order_acquire);
  if (slot < 0) return result;
  LOOM_CHECK(static_cast<uint32_t>(slot) < header.slot_count, CorruptData, where,
             ": the latest slot is ", slot, " of ", header.slot_count);
  const SlotHeader& s = header.slots[slot];
  const uint64_t seq = s.seq.load(std::memory_order_acquire);
  result.version = s.version.load(std::memory_order_relaxed);
  result.checksum = s.checksum.load(std::memory_order_relaxed);
  bool copied = false;
  if ((seq & 1) == 0 && result.version > newer_than) {
    util::Hasher64 hasher;
    const uint8_t* source =
        base + header.data_offset + static_cast<uint64_t>(slot) * header.slot_stride;
    for (const Span& span : spans) {
      copy_and_hash(span.data, source, span.bytes, hasher);
      source += span.bytes;
    }
    result.computed = hasher.digest();
    copied = true;
    if (during_copy) during_copy();
  }
  fence(std::memory_order_acquire);
  if ((seq & 1) != 0 || s.seq.load(std::memory_order_relaxed) != seq) {
    result.status = ReadStatus::kTorn;
  } else {
    result.status = copied ? ReadStatus::kOk : ReadStatus::kNothingNewer;
  }
  return result;
}

std::string request_line(const Request& request) {
  return json{{"newer_than", request.newer_than}, {"timeout_ms", request.timeout_ms}}.dump() + "\n";
}

Request parse_request(const std::string& line, const std::string& where) {
  const json value = json::parse(line, nullptr, /*allow_exceptions=*/false);
  LOOM_CHECK(value.is_object(), CorruptData, where,
             ": a request is one line of JSON {\"newer_than\": N, \"timeout_ms\": T}");
  Request request;
  request.newer_than =
      util::integer_field<int64_t>(field(value, "newer_than", where), "newer_than", where);
  request.timeout_ms = std::clamp<int64_t>(
      util::integer_field<int64_t>(field(value, "timeout_ms", where), "timeout_ms", where), 0,
      kMaxTimeoutMs);
  return request;
}

std::string reply_line(const Reply& reply) {
  json value = {{"format", "loom-weights"},
                {"format_version", kFormatVersion},
                {"status", reply.status},
                {"latest", reply.latest}};
  if (reply.status == "ok") {
    value["version"] = reply.version;
    value["xxhash64"] = util::hash_hex(reply.checksum);
    value["bytes"] = reply.layout.total_bytes;
    value["tensors"] = layout_json(reply.layout);
  }
  if (!reply.message.empty()) value["message"] = reply.message;
  return value.dump() + "\n";
}

Reply parse_reply(const std::string& line, uint64_t max_bytes, const std::string& where) {
  const json value = json::parse(line, nullptr, /*allow_exceptions=*/false);
  LOOM_CHECK(value.is_object() && value.value("format", json()) == "loom-weights", CorruptData,
             where, " did not answer with a Loom weights header (is it a Loom publisher?)");
  const auto version =
      util::integer_field<uint32_t>(field(value, "format_version", where), "format_version", where);
  LOOM_CHECK(version == kFormatVersion, CorruptData, where, " speaks format version ", version,
             "; this Loom reads version ", kFormatVersion);
  Reply reply;
  reply.status = string_field(value, "status", where);
  reply.latest = util::integer_field<int64_t>(field(value, "latest", where), "latest", where);
  if (value.contains("message")) reply.message = string_field(value, "message", where);
  if (reply.status != "ok") {
    LOOM_CHECK(reply.status == "none" || reply.status == "closed" || reply.status == "busy",
               CorruptData, where, ": unknown status \"", reply.status, "\"");
    return reply;
  }
  reply.version = util::integer_field<int64_t>(field(value, "version", where), "version", where);
  reply.checksum = util::parse_hash_hex(string_field(value, "xxhash64", where), where);
  const auto bytes = util::integer_field<uint64_t>(field(value, "bytes", where), "bytes", where);
  reply.layout = parse_layout(field(value, "tensors", where), where);
  LOOM_CHECK(bytes == reply.layout.total_bytes, CorruptData, where, ": \"bytes\" is ", bytes,
             " but the tensors hold ", reply.layout.total_bytes);
  LOOM_CHECK(bytes <= max_bytes, CorruptData, where, ": version ", reply.version, " has ", bytes,
             " bytes, more than WeightSubscriberOptions::max_bytes (", max_bytes, ")");
  return reply;
}

}  // namespace loom::control::weights
