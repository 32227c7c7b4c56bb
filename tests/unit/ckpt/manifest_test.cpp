// Manifest JSON, step directory names, dtype names, and merging the ranks' reports.
#include "ckpt/manifest.h"

#include <gtest/gtest.h>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::ckpt {
namespace {

using loom::testing::error_of;

Piece piece(const std::string& file, int64_t begin, int64_t end) {
  return {file, begin, end, 0, static_cast<uint64_t>(end - begin) * 4, 7, 1 << 20, {7}};
}

TEST(Manifest, StepDirectoryNames) {
  EXPECT_EQ(step_dir_name(1000), "step_00001000");
  EXPECT_EQ(step_dir_name(123456789), "step_123456789");
  EXPECT_EQ(parse_step_dir_name("step_00001000"), 1000);
  EXPECT_EQ(parse_step_dir_name("step_123456789"), 123456789);
  EXPECT_EQ(parse_step_dir_name("step_0001"), std::nullopt);
  EXPECT_EQ(parse_step_dir_name("step_0000100x"), std::nullopt);
  EXPECT_EQ(parse_step_dir_name(".step_00001000.tmp"), std::nullopt);
  EXPECT_EQ(data_file_name(3), "rank_00003.data");
}

TEST(Manifest, DtypeNamesRoundTrip) {
  for (auto type : {c10::ScalarType::Float, c10::ScalarType::BFloat16, c10::ScalarType::Long,
                    c10::ScalarType::Bool, c10::ScalarType::Half})
    EXPECT_EQ(parse_dtype(dtype_name(type)), type);
  EXPECT_THROW(parse_dtype("float33"), CorruptData);
}

TEST(Manifest, JsonRoundTrips) {
  Manifest m;
  m.step = 42;
  m.world_size = 2;
  m.files = {{"rank_00000.data", 0, 100}, {"rank_00001.data", 1, 60}};
  m.tensors.push_back({"w", "float32", {10, 4}, "rows", {piece("rank_00000.data", 0, 20)}});
  m.blobs["reader"] = R"({"epoch":1,"position":640})";
  Manifest back = parse_manifest(to_json(m), "test");
  EXPECT_EQ(back.step, 42);
  EXPECT_EQ(back.world_size, 2);
  EXPECT_EQ(back.data_bytes(), 160u);
  ASSERT_NE(back.find("w"), nullptr);
  EXPECT_EQ(back.find("w")->shape, (std::vector<int64_t>{10, 4}));
  EXPECT_EQ(back.find("w")->pieces[0].end, 20);
  EXPECT_EQ(back.find("w")->pieces[0].chunk_hashes, std::vector<uint64_t>{7});
  EXPECT_EQ(back.blobs.at("reader"), R"({"epoch":1,"position":640})");
}

TEST(Manifest, MalformedManifestIsCorruptDataNamingIt) {
  EXPECT_NE(error_of<CorruptData>([] {
              parse_manifest("{\"format\": 1", "dir/manifest.json");
            }).find("dir/manifest.json"),
            std::string::npos);
  EXPECT_THROW(parse_manifest("{}", "x"), CorruptData);
}

TEST(Manifest, MergeJoinsSortsAndChecksCoverage) {
  Manifest r0, r1;
  r0.files = {{"rank_00000.data", 0, 80}};
  r1.files = {{"rank_00001.data", 1, 80}};
  r0.tensors.push_back({"w", "float32", {40}, "flat", {piece("rank_00000.data", 20, 40)}});
  r1.tensors.push_back({"w", "float32", {40}, "flat", {piece("rank_00001.data", 0, 20)}});
  Manifest m = merge_reports(3, {r0, r1});
  ASSERT_EQ(m.find("w")->pieces.size(), 2u);
  EXPECT_EQ(m.find("w")->pieces[0].file, "rank_00001.data");
  EXPECT_EQ(m.world_size, 2);

  Manifest gap = r1;
  gap.tensors[0].pieces[0].end = 10;
  EXPECT_NE(error_of<InvalidArgument>([&] {
              merge_reports(3, {r0, gap});
            }).find("no rank holds elements [10, 20) of tensor \"w\""),
            std::string::npos);
  Manifest other_shape = r1;
  other_shape.tensors[0].shape = {41};
  EXPECT_NE(error_of<InvalidArgument>([&] {
              merge_reports(3, {r0, other_shape});
            }).find("tensor \"w\""),
            std::string::npos);
}

}  // namespace
}  // namespace loom::ckpt
