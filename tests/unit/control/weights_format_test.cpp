// The bytes of weight snapshots: layouts, segment headers, the sequence lock and the TCP lines,
// without a publisher.
#include "control/weights_format.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>

#include "harness/harness.h"
#include "loom/error.h"
#include "util/dtype.h"

namespace loom::control::weights {
namespace {

using nlohmann::json;
using testing::error_of;

Layout two_tensor_layout() {
  return layout_of({{"b", at::zeros({2, 3}, at::kFloat)}, {"a", at::zeros({4}, at::kLong)}});
}

TEST(WeightsFormat, LayoutIsInNameOrderBackToBack) {
  const Layout layout = two_tensor_layout();
  ASSERT_EQ(layout.tensors.size(), 2u);
  EXPECT_EQ(layout.tensors[0].name, "a");
  EXPECT_EQ(layout.tensors[0].dtype, at::kLong);
  EXPECT_EQ(layout.tensors[0].shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(layout.tensors[0].offset, 0u);
  EXPECT_EQ(layout.tensors[0].bytes, 32u);
  EXPECT_EQ(layout.tensors[1].name, "b");
  EXPECT_EQ(layout.tensors[1].offset, 32u);
  EXPECT_EQ(layout.tensors[1].bytes, 24u);
  EXPECT_EQ(layout.total_bytes, 56u);
  EXPECT_EQ(layout_json(layout).dump(),
            R"([{"bytes":32,"dtype":"int64","name":"a","offset":0,"shape":[4]},)"
            R"({"bytes":24,"dtype":"float32","name":"b","offset":32,"shape":[2,3]}])");
  const Layout parsed = parse_layout(layout_json(layout), "test");
  EXPECT_EQ(parsed.tensors, layout.tensors);
  EXPECT_EQ(parsed.total_bytes, 56u);
}

TEST(WeightsFormat, UndefinedTensorsAreRefusedNamingThem) {
  EXPECT_EQ(error_of<InvalidArgument>([] {
              layout_of({{"w", at::Tensor()}});
            }),
            "weights: tensor \"w\" is undefined: publish defined tensors only");
}

TEST(WeightsFormat, LayoutDifferencesNameTheTensor) {
  const Layout published = two_tensor_layout();
  EXPECT_EQ(layout_difference(published, two_tensor_layout()), "");
  EXPECT_EQ(layout_difference(published, layout_of({{"a", at::zeros({4}, at::kLong)},
                                                    {"b", at::zeros({2, 3}, at::kDouble)}})),
            "tensor \"b\" is float32 [2, 3] in the published layout and float64 [2, 3] here");
  EXPECT_EQ(layout_difference(published, layout_of({{"a", at::zeros({5}, at::kLong)},
                                                    {"b", at::zeros({2, 3}, at::kFloat)}})),
            "tensor \"a\" is int64 [4] in the published layout and int64 [5] here");
  EXPECT_EQ(layout_difference(published, layout_of({{"a", at::zeros({4}, at::kLong)}})),
            "tensor \"b\" of the published layout is missing");
  EXPECT_EQ(layout_difference(published, layout_of({{"a", at::zeros({4}, at::kLong)},
                                                    {"b", at::zeros({2, 3}, at::kFloat)},
                                                    {"c", at::zeros({1}, at::kFloat)}})),
            "tensor \"c\" is not in the published layout (fixed by the first publish)");
}

// Every entry a hostile segment or peer could send is refused before it sizes anything.
TEST(WeightsFormat, HostileLayoutsAreCorruptDataNamingTheEntry) {
  const auto error = [](const std::string& text) {
    return error_of<CorruptData>([&] { parse_layout(json::parse(text), "peer"); });
  };
  EXPECT_EQ(error(R"({"a": 1})"), "peer: the layout is not a JSON array");
  EXPECT_EQ(error(R"([{"name": "b", "dtype": "float32", "shape": [1], "offset": 0, "bytes": 4},)"
                  R"({"name": "a", "dtype": "float32", "shape": [1], "offset": 4, "bytes": 4}])"),
            "peer: layout entry 1 (\"a\") is not after \"b\": names must be unique and in order");
  EXPECT_EQ(
      error(R"([{"name": "a", "dtype": "float31", "shape": [1], "offset": 0, "bytes": 4}])"),
      "peer: layout entry 0 (\"a\") has dtype \"float31\", not one of " + util::dtype_names());
  EXPECT_EQ(error(R"([{"name": "a", "dtype": "float32", "shape": [-1], "offset": 0, "bytes": 4}])"),
            "peer: layout entry 0 (\"a\"): size -1 is outside [0, 2^48]");
  EXPECT_EQ(error(R"([{"name": "a", "dtype": "float32", "shape": [281474976710656, )"
                  R"(281474976710656], "offset": 0, "bytes": 0}])"),
            "peer: layout entry 0 (\"a\"): shape [281474976710656,281474976710656] holds more "
            "than 2^46 bytes");
  EXPECT_EQ(error(R"([{"name": "a", "dtype": "float32", "shape": [2], "offset": 0, "bytes": 4}])"),
            "peer: layout entry 0 (\"a\"): 4 bytes, but float32 [2] has 8");
  EXPECT_EQ(error(R"([{"name": "a", "dtype": "float32", "shape": [1], "offset": 8, "bytes": 4}])"),
            "peer: layout entry 0 (\"a\"): offset 8 where the tensors before it end at 0");
  EXPECT_EQ(error(R"([{"name": "a", "dtype": "float32", "shape": [1], "offset": -1, "bytes": 4}])"),
            "peer: layout entry 0: \"offset\" is -1, not a non-negative integer that fits 64 bits");
  EXPECT_EQ(error(R"([{"name": "a", "dtype": "float32", "offset": 0, "bytes": 4}])"),
            "peer: layout entry 0: \"shape\" is missing");
}

// A segment's header, in memory aligned as a mapping would be.
struct FakeSegment {
  explicit FakeSegment(int slots, uint64_t data_bytes) {
    const std::string layout = "[]";
    const Geometry g = geometry(slots, layout.size(), data_bytes);
    bytes = g.segment_bytes;
    memory.reset(static_cast<uint8_t*>(std::aligned_alloc(kPage, g.segment_bytes)));
    header = new (memory.get()) SegmentHeader();
    header->format_version = kFormatVersion;
    header->slot_count = static_cast<uint32_t>(slots);
    header->layout_offset = g.layout_offset;
    header->layout_bytes = layout.size();
    header->data_offset = g.data_offset;
    header->slot_stride = g.slot_stride;
    header->data_bytes = data_bytes;
    header->segment_bytes = g.segment_bytes;
    header->magic.store(kMagic);
  }
  uint8_t* slot(int i) const {
    return memory.get() + header->data_offset + i * header->slot_stride;
  }

  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> memory;
  SegmentHeader* header = nullptr;
  uint64_t bytes = 0;
};

TEST(WeightsFormat, HeadersAreCheckedAgainstTheFile) {
  FakeSegment segment(3, 100);
  EXPECT_EQ(segment.header->data_offset, kHeaderRegion + kPage);
  EXPECT_EQ(segment.header->slot_stride, kPage);
  EXPECT_EQ(segment.bytes, kHeaderRegion + 4 * kPage);
  check_header(*segment.header, segment.bytes, "seg");
  EXPECT_EQ(error_of<CorruptData>([&] { check_header(*segment.header, segment.bytes + 1, "seg"); }),
            "seg has " + std::to_string(segment.bytes + 1) + " bytes where its header says " +
                std::to_string(segment.bytes));
  segment.header->slot_count = 2;
  EXPECT_EQ(error_of<CorruptData>([&] { check_header(*segment.header, segment.bytes, "seg"); }),
            "seg: slot count 2 is outside [3, 64]");
  segment.header->slot_count = 3;
  segment.header->data_bytes = 5000;  // needs two pages per slot: the offsets no longer agree
  EXPECT_EQ(error_of<CorruptData>([&] { check_header(*segment.header, segment.bytes, "seg"); }),
            "seg: the header's offsets do not match its sizes");
  segment.header->format_version = 2;
  EXPECT_EQ(error_of<CorruptData>([&] { check_header(*segment.header, segment.bytes, "seg"); }),
            "seg has format version 2; this Loom reads version 1: publisher and subscriber must "
            "run the same Loom release");
  segment.header->magic.store(7);
  EXPECT_EQ(error_of<CorruptData>([&] { check_header(*segment.header, segment.bytes, "seg"); }),
            "seg is not a Loom weights segment (magic 7)");
}

// Writes `version` into `slot`: 8 bytes, each the version's low byte.
void write_version(FakeSegment& segment, int slot, int64_t version) {
  begin_write(*segment.header, slot);
  std::memset(segment.slot(slot), static_cast<int>(version & 0xff), 8);
  end_write(*segment.header, slot, version, util::xxh64(segment.slot(slot), 8));
}

TEST(WeightsFormat, TheSequenceLockReturnsWholeVersionsAndFlagsTornOnes) {
  FakeSegment segment(3, 8);
  uint8_t out[8] = {};
  const std::vector<Span> spans = {{out, 4}, {out + 4, 4}};
  EXPECT_EQ(read_newest(*segment.header, segment.memory.get(), -1, spans, "seg").status,
            ReadStatus::kNothingNewer);

  write_version(segment, 0, 5);
  ReadResult read = read_newest(*segment.header, segment.memory.get(), -1, spans, "seg");
  EXPECT_EQ(read.status, ReadStatus::kOk);
  EXPECT_EQ(read.version, 5);
  EXPECT_EQ(read.computed, read.checksum);
  EXPECT_EQ(std::vector<uint8_t>(out, out + 8), std::vector<uint8_t>(8, 5));
  EXPECT_EQ(segment.header->publishes.load(), 1u);

  // Nothing newer than 5: the newest is reported, nothing copied.
  std::memset(out, 0, sizeof out);
  read = read_newest(*segment.header, segment.memory.get(), 5, spans, "seg");
  EXPECT_EQ(read.status, ReadStatus::kNothingNewer);
  EXPECT_EQ(read.version, 5);
  EXPECT_EQ(out[0], 0);

  // The publisher laps the ring while a reader copies slot 0: the copy is torn.
  read = read_newest(*segment.header, segment.memory.get(), -1, spans, "seg", [&] {
    write_version(segment, 1, 6);
    write_version(segment, 2, 7);
    write_version(segment, 0, 8);
  });
  EXPECT_EQ(read.status, ReadStatus::kTorn);
  // A slot being written (seq odd) is torn too, whatever its bytes.
  begin_write(*segment.header, 0);
  EXPECT_EQ(read_newest(*segment.header, segment.memory.get(), -1, spans, "seg").status,
            ReadStatus::kTorn);
  end_write(*segment.header, 0, 9, 0);
  read = read_newest(*segment.header, segment.memory.get(), -1, spans, "seg");
  EXPECT_EQ(read.status, ReadStatus::kOk);
  EXPECT_EQ(read.version, 9);
  EXPECT_NE(read.computed, read.checksum);  // the caller refuses it as CorruptData

  segment.header->latest_slot.store(3);
  EXPECT_EQ(error_of<CorruptData>(
                [&] { read_newest(*segment.header, segment.memory.get(), -1, spans, "seg"); }),
            "seg: the latest slot is 3 of 3");
}

TEST(WeightsFormat, RequestsAndRepliesRoundTripAndHostileOnesAreRefused) {
  EXPECT_EQ(request_line({.newer_than = 4, .timeout_ms = 250}),
            "{\"newer_than\":4,\"timeout_ms\":250}\n");
  const Request request = parse_request(R"({"newer_than": -1, "timeout_ms": 99999999999})", "r");
  EXPECT_EQ(request.newer_than, -1);
  EXPECT_EQ(request.timeout_ms, 600000);  // clamped to 10 minutes
  EXPECT_EQ(error_of<CorruptData>([] { parse_request("GET /", "r"); }),
            "r: a request is one line of JSON {\"newer_than\": N, \"timeout_ms\": T}");

  Reply reply;
  reply.status = "ok";
  reply.version = 3;
  reply.latest = 3;
  reply.checksum = 0xabcdef;
  reply.layout = two_tensor_layout();
  const std::string line = reply_line(reply);
  EXPECT_EQ(line.back(), '\n');
  const Reply parsed = parse_reply(line, 1000, "peer");
  EXPECT_EQ(parsed.status, "ok");
  EXPECT_EQ(parsed.version, 3);
  EXPECT_EQ(parsed.checksum, 0xabcdefu);
  EXPECT_EQ(parsed.layout.tensors, reply.layout.tensors);
  EXPECT_EQ(error_of<CorruptData>([&] { parse_reply(line, 50, "peer"); }),
            "peer: version 3 has 56 bytes, more than WeightSubscriberOptions::max_bytes (50)");

  json claims = json::parse(line);
  claims["bytes"] = 57;
  EXPECT_EQ(error_of<CorruptData>([&] { parse_reply(claims.dump(), 1000, "peer"); }),
            "peer: \"bytes\" is 57 but the tensors hold 56");
  EXPECT_EQ(error_of<CorruptData>([] { parse_reply("HTTP/1.1 400 Bad Request", 1000, "peer"); }),
            "peer did not answer with a Loom weights header (is it a Loom publisher?)");
  EXPECT_EQ(error_of<CorruptData>([] {
              parse_reply(R"({"format": "loom-weights", "format_version": 1, "status": "maybe",)"
                          R"( "latest": 1})",
                          1000, "peer");
            }),
            "peer: unknown status \"maybe\"");
  const Reply none = parse_reply(
      R"({"format": "loom-weights", "format_version": 1, "status": "none", "latest": 7})", 0, "p");
  EXPECT_EQ(none.status, "none");
  EXPECT_EQ(none.latest, 7);
}

TEST(WeightsFormat, NamesArePlain) {
  check_name("policy-v2.main_1");
  for (const std::string& bad :
       std::vector<std::string>{"", "a/b", ".hidden", "a b", std::string(201, 'a')}) {
    EXPECT_NE(
        error_of<InvalidArgument>([&] { check_name(bad); }).find("must be 1 to 200 characters"),
        std::string::npos)
        << bad;
  }
  EXPECT_EQ(segment_path("p"), "/dev/shm/loom-weights-p");
}

}  // namespace
}  // namespace loom::control::weights
