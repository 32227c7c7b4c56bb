// Record layouts through the public API: RL episodes (whole or as transitions, with returns and
// GAE advantages against a plain reference) and multimodal sequences (ragged tokens, lists of
// PNG, JPEG and raw images), written, read back element by element, resumed, and refused when
// a record breaks the layout's rules.
#include "data/layout.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "data/collate.h"
#include "data/image_codec.h"
#include "harness/harness.h"
#include "loom/data/reader.h"
#include "loom/error.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

// One episode as written: observation [T, 3], action [T], reward, done, value [T].
struct Episode {
  std::vector<float> observation;
  std::vector<int64_t> action;
  std::vector<float> reward;
  std::vector<uint8_t> done;
  std::vector<float> value;
  int64_t length() const { return static_cast<int64_t>(reward.size()); }
};

std::vector<Field> episode_schema() {
  return {{"id", FieldType::kInt},
          {"observation", FieldType::kTensor, "float32", {}, {}, true},
          {"action", FieldType::kTensor, "int64", {}, {}, true},
          {"reward", FieldType::kTensor, "float32", {}, {}, true},
          {"done", FieldType::kTensor, "uint8", {}, {}, true},
          {"value", FieldType::kTensor, "float32", {}, {}, true}};
}

Record episode_record(int64_t id, const Episode& e) {
  const int64_t t = e.length();
  return Record()
      .integer(id)
      .tensor(e.observation.data(), e.observation.size() * 4, {t, 3})
      .tensor(e.action.data(), e.action.size() * 8, {static_cast<int64_t>(e.action.size())})
      .tensor(e.reward.data(), e.reward.size() * 4, {t})
      .tensor(e.done.data(), e.done.size(), {static_cast<int64_t>(e.done.size())})
      .tensor(e.value.data(), e.value.size() * 4, {t});
}

std::vector<Episode> make_episodes(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<Episode> out(static_cast<size_t>(count));
  for (Episode& e : out) {
    const int length = 1 + static_cast<int>(rng() % 9);
    for (int t = 0; t < length; ++t) {
      for (int k = 0; k < 3; ++k) e.observation.push_back(u(rng));
      e.action.push_back(static_cast<int64_t>(rng() % 4));
      e.reward.push_back(u(rng));
      e.done.push_back(t == length - 1 && rng() % 2 ? 1 : 0);  // some end truncated
      e.value.push_back(u(rng));
    }
  }
  return out;
}

fs::path write_episodes(const TempDir& dir, const std::vector<Episode>& episodes) {
  const fs::path ds = dir.path() / "episodes";
  RecordDatasetWriter writer(ds, episode_schema(),
                             {.bytes_per_shard = 400, .layout = RecordLayout::kEpisodes});
  for (size_t i = 0; i < episodes.size(); ++i) {
    writer.add(episode_record(static_cast<int64_t>(i), episodes[i]));
  }
  writer.finish();
  return ds;
}

// The reference: returns and GAE written the textbook way, in double.
std::vector<double> reference_returns(const Episode& e, double gamma) {
  std::vector<double> g(e.reward.size());
  for (int64_t t = e.length() - 1; t >= 0; --t) {
    const double next = t + 1 < e.length() && !e.done[t] ? g[t + 1] : 0.0;
    g[t] = e.reward[t] + gamma * next;
  }
  return g;
}

std::vector<double> reference_advantages(const Episode& e, double gamma, double lambda) {
  std::vector<double> a(e.reward.size());
  for (int64_t t = e.length() - 1; t >= 0; --t) {
    const bool last = t + 1 == e.length() || e.done[t];
    const double next_value = last ? 0.0 : e.value[t + 1];
    const double delta = e.reward[t] + gamma * next_value - e.value[t];
    a[t] = delta + (last ? 0.0 : gamma * lambda * a[t + 1]);
  }
  return a;
}

// Float32 results of a float64 computation: within one float32 rounding of the reference
// (relative 2^-24, with an absolute floor for values near zero).
void expect_close(float got, double want, const std::string& what) {
  EXPECT_LE(std::abs(got - want), 6e-8 * std::max(1.0, std::abs(want))) << what;
}

TEST(Episodes, WholeEpisodesArePaddedWithMasksReturnsAndAdvantages) {
  TempDir dir;
  const std::vector<Episode> episodes = make_episodes(11, 1);
  const fs::path ds = write_episodes(dir, episodes);
  EXPECT_EQ(read_manifest(ds).layout, RecordLayout::kEpisodes);
  Reader reader(ds, {.batch_size = 4, .seed = 3, .gamma = 0.9, .gae_lambda = 0.8, .prefetch = 0});
  EXPECT_EQ(reader.num_samples(), 11u);
  for (int step = 0; step < 2; ++step) {
    const Batch b = reader.next();
    const int64_t longest = b["reward"].size(1);
    int64_t want_longest = 0;
    for (uint64_t i : b.indices) want_longest = std::max(want_longest, episodes[i].length());
    ASSERT_EQ(longest, want_longest);
    for (size_t r = 0; r < b.indices.size(); ++r) {
      const Episode& e = episodes[b.indices[r]];
      const auto ri = static_cast<int64_t>(r);
      EXPECT_EQ(b["id"][ri].item<int64_t>(), static_cast<int64_t>(b.indices[r]));
      const std::vector<double> g = reference_returns(e, 0.9);
      const std::vector<double> a = reference_advantages(e, 0.9, 0.8);
      for (int64_t t = 0; t < longest; ++t) {
        const bool real = t < e.length();
        const std::string at =
            "episode " + std::to_string(b.indices[r]) + " step " + std::to_string(t);
        EXPECT_EQ(b["reward_mask"][ri][t].item<bool>(), real) << at;
        EXPECT_EQ(b["observation_mask"][ri][t].item<bool>(), real) << at;
        for (int k = 0; k < 3; ++k) {
          EXPECT_EQ(b["observation"][ri][t][k].item<float>(), real ? e.observation[t * 3 + k] : 0)
              << at;
        }
        EXPECT_EQ(b["action"][ri][t].item<int64_t>(), real ? e.action[t] : 0) << at;
        EXPECT_EQ(b["reward"][ri][t].item<float>(), real ? e.reward[t] : 0) << at;
        EXPECT_EQ(b["done"][ri][t].item<uint8_t>(), real ? e.done[t] : 0) << at;
        EXPECT_EQ(b["value"][ri][t].item<float>(), real ? e.value[t] : 0) << at;
        expect_close(b["return"][ri][t].item<float>(), real ? g[t] : 0.0, at + " return");
        expect_close(b["advantage"][ri][t].item<float>(), real ? a[t] : 0.0, at + " advantage");
      }
    }
  }
}

TEST(Episodes, TransitionsVisitEveryStepOnceAcrossRanksAndResumeExactly) {
  TempDir dir;
  const std::vector<Episode> episodes = make_episodes(13, 2);
  const fs::path ds = write_episodes(dir, episodes);
  uint64_t total = 0;
  std::vector<uint64_t> first_step;
  for (const Episode& e : episodes) {
    first_step.push_back(total);
    total += static_cast<uint64_t>(e.length());
  }
  auto options = [](int rank, int world, int64_t batch) {
    return ReaderOptions{.batch_size = batch,
                         .seed = 5,
                         .rank = rank,
                         .world_size = world,
                         .episode_sampling = EpisodeSampling::kTransition,
                         .gamma = 0.95,
                         .gae_lambda = 0.9,
                         .prefetch = 0};
  };
  Reader r0(ds, options(0, 2, 3)), r1(ds, options(1, 2, 3));
  ASSERT_EQ(r0.num_samples(), total);
  std::set<uint64_t> seen;
  for (uint64_t s = 0; s < r0.steps_per_epoch(); ++s) {
    for (Reader* reader : {&r0, &r1}) {
      const Batch b = reader->next();
      for (int64_t r = 0; r < b.num_real; ++r) {
        const int64_t e = b["episode"][r].item<int64_t>(), t = b["step"][r].item<int64_t>();
        const Episode& ep = episodes[static_cast<size_t>(e)];
        EXPECT_EQ(first_step[static_cast<size_t>(e)] + static_cast<uint64_t>(t), b.indices[r]);
        EXPECT_TRUE(seen.insert(b.indices[r]).second) << "transition " << b.indices[r] << " twice";
        EXPECT_EQ(b["id"][r].item<int64_t>(), e);
        for (int k = 0; k < 3; ++k) {
          EXPECT_EQ(b["observation"][r][k].item<float>(), ep.observation[t * 3 + k]);
        }
        EXPECT_EQ(b["action"][r].item<int64_t>(), ep.action[t]);
        EXPECT_EQ(b["reward"][r].item<float>(), ep.reward[t]);
        EXPECT_EQ(b["done"][r].item<uint8_t>(), ep.done[t]);
        expect_close(b["return"][r].item<float>(), reference_returns(ep, 0.95)[t], "return");
        expect_close(b["advantage"][r].item<float>(), reference_advantages(ep, 0.95, 0.9)[t],
                     "advantage");
      }
      EXPECT_EQ(b["observation"].sizes(), (std::vector<int64_t>{3, 3}));
      EXPECT_FALSE(b.tensors.count("reward_mask"));
    }
  }
  EXPECT_EQ(seen.size(), total - total % 6);  // drop-last: whole global batches of 6

  // Resume: 3 steps, then a new reader from the state gives what an uninterrupted one gives.
  Reader whole(ds, options(0, 1, 4)), first(ds, options(0, 1, 4));
  for (int s = 0; s < 3; ++s) first.next();
  Reader resumed(ds, options(0, 1, 4));
  resumed.restore(first.state());
  for (int s = 0; s < 3; ++s) whole.next();
  for (int s = 0; s < 6; ++s) {
    const Batch want = whole.next(), got = resumed.next();
    EXPECT_EQ(got.indices, want.indices);
    for (const auto& [name, tensor] : want.tensors) {
      EXPECT_TRUE(at::equal(got[name], tensor)) << name;
    }
  }
}

TEST(Episodes, FieldsOfDifferentLengthsAreRefusedNamingTheRecordAndFields) {
  TempDir dir;
  std::vector<Episode> episodes = make_episodes(3, 3);
  episodes[2].action.push_back(1);
  RecordDatasetWriter writer(dir.path() / "bad", episode_schema(),
                             {.layout = RecordLayout::kEpisodes});
  writer.add(episode_record(0, episodes[0]));
  writer.add(episode_record(1, episodes[1]));
  const int64_t t = episodes[2].length();
  EXPECT_EQ(error_of<InvalidArgument>([&] { writer.add(episode_record(2, episodes[2])); }),
            "record 2: field 'action' has " + std::to_string(t + 1) +
                " steps but field 'reward' has " + std::to_string(t) +
                "; every per-step field of an episode has one entry per step");
  // A per-step scalar field with a second dimension would feed the returns the wrong values.
  std::vector<float> wide(static_cast<size_t>(2 * episodes[0].length()), 1.0f);
  Episode two_d = episodes[0];
  Record record =
      Record()
          .integer(3)
          .tensor(two_d.observation.data(), two_d.observation.size() * 4, {two_d.length(), 3})
          .tensor(two_d.action.data(), two_d.action.size() * 8, {two_d.length()})
          .tensor(wide.data(), wide.size() * 4, {two_d.length(), 2})
          .tensor(two_d.done.data(), two_d.done.size(), {two_d.length()})
          .tensor(two_d.value.data(), two_d.value.size() * 4, {two_d.length()});
  EXPECT_EQ(writer.records_written(), 2u);  // the bad record was not written
  RecordDatasetWriter fresh(dir.path() / "bad2", episode_schema(),
                            {.layout = RecordLayout::kEpisodes});
  EXPECT_EQ(error_of<InvalidArgument>([&] { fresh.add(record); }),
            "record 0: field 'reward' must hold one value per step (shape [T]); it has 2 "
            "dimensions");
}

TEST(Episodes, TheSchemaMustFitTheLayout) {
  TempDir dir;
  std::vector<Field> schema = episode_schema();
  schema.erase(schema.begin() + 3);  // reward
  EXPECT_EQ(error_of<InvalidArgument>([&] {
              RecordDatasetWriter(dir.path() / "a", schema, {.layout = RecordLayout::kEpisodes});
            }),
            "record schema: the episodes layout needs a field 'reward'");
  schema = episode_schema();
  schema[4].dtype = "float32";  // done
  EXPECT_EQ(error_of<InvalidArgument>([&] {
              RecordDatasetWriter(dir.path() / "b", schema, {.layout = RecordLayout::kEpisodes});
            }),
            "record schema: field 'done' of the episodes layout must be a ragged uint8 or bool "
            "tensor");
  schema = episode_schema();
  schema[0].ragged = true;  // an int field
  EXPECT_EQ(error_of<InvalidArgument>([&] { RecordDatasetWriter(dir.path() / "c", schema); }),
            "record schema: field 'id' is ragged but is not a tensor with a per-record shape");

  // Transitions of a dataset that is not made of episodes.
  RecordDatasetWriter plain(dir.path() / "plain", {{"x", FieldType::kInt}});
  plain.add(Record().integer(1));
  plain.finish();
  EXPECT_EQ(error_of<InvalidArgument>([&] {
              Reader(dir.path() / "plain", {.episode_sampling = EpisodeSampling::kTransition});
            }),
            "transition sampling reads episode datasets; " + (dir.path() / "plain").string() +
                " has the plain layout");
}

// ---- multimodal ----

// A deterministic image of h x w x c pixels.
std::vector<uint8_t> pattern(int64_t h, int64_t w, int64_t c, int seed) {
  std::vector<uint8_t> p(static_cast<size_t>(h * w * c));
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<uint8_t>((i * 7 + seed * 31) % 251);
  return p;
}

std::vector<Field> multimodal_schema() {
  return {{"tokens", FieldType::kTensor, "int32", {}, {}, true},
          {"images", FieldType::kImages},
          {"image_positions", FieldType::kTensor, "int64", {}, {}, true},
          {"source", FieldType::kText}};
}

struct Sequence {
  std::vector<int32_t> tokens;
  std::vector<std::string> images;  // encoded
  std::vector<int64_t> positions;
};

Record sequence_record(const Sequence& s) {
  return Record()
      .tensor(s.tokens.data(), s.tokens.size() * 4, {static_cast<int64_t>(s.tokens.size())})
      .images(s.images)
      .tensor(s.positions.data(), s.positions.size() * 8,
              {static_cast<int64_t>(s.positions.size())})
      .text("seq");
}

TEST(Multimodal, TokensAndImagesOfEveryEncodingCollateIntoPaddedTensorsWithMasks) {
  TempDir dir;
  std::vector<Sequence> seqs(4);
  seqs[0] = {{1, 2, 3, 4, 5}, {image::encode_png(pattern(5, 7, 3, 0).data(), 5, 7, 3)}, {2}};
  seqs[1] = {{6, 7},
             {image::encode_raw(pattern(3, 2, 3, 1).data(), 3, 2, 3),
              image::encode_jpeg(pattern(8, 8, 3, 2).data(), 8, 8, 3, 95)},
             {0, 2}};
  seqs[2] = {{8, 9, 10}, {}, {}};
  seqs[3] = {{11}, {image::encode_png(pattern(4, 9, 3, 3).data(), 4, 9, 3)}, {1}};
  const fs::path ds = dir.path() / "mm";
  RecordDatasetWriter writer(ds, multimodal_schema(), {.layout = RecordLayout::kMultimodal});
  for (const Sequence& s : seqs) writer.add(sequence_record(s));
  writer.finish();

  Reader reader(ds, {.batch_size = 4, .prefetch = 0});
  const Batch b = reader.read({0, 1, 2, 3});
  EXPECT_EQ(b["tokens"].sizes(), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(b["images"].sizes(), (std::vector<int64_t>{4, 2, 8, 9, 3}));
  EXPECT_EQ(b["images_size"].sizes(), (std::vector<int64_t>{4, 2, 2}));
  EXPECT_EQ(b["images_mask"].sizes(), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(b["image_positions"].sizes(), (std::vector<int64_t>{4, 2}));
  for (int64_t r = 0; r < 4; ++r) {
    const Sequence& s = seqs[static_cast<size_t>(r)];
    for (int64_t t = 0; t < 5; ++t) {
      const bool real = t < static_cast<int64_t>(s.tokens.size());
      EXPECT_EQ(b["tokens"][r][t].item<int32_t>(), real ? s.tokens[t] : 0);
      EXPECT_EQ(b["tokens_mask"][r][t].item<bool>(), real);
    }
    for (int64_t k = 0; k < 2; ++k) {
      const bool real = k < static_cast<int64_t>(s.images.size());
      EXPECT_EQ(b["images_mask"][r][k].item<bool>(), real);
      EXPECT_EQ(b["image_positions_mask"][r][k].item<bool>(), real);
      EXPECT_EQ(b["image_positions"][r][k].item<int64_t>(), real ? s.positions[k] : 0);
      // Every pixel: the decoded image at the top left, zeros elsewhere. JPEG is compared with
      // the same decoder's output (lossy, but deterministic).
      image::Info info;
      std::vector<uint8_t> want(8 * 9 * 3, 0);
      if (real) {
        const std::string& bytes = s.images[k];
        const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
        ASSERT_EQ(image::probe(p, bytes.size(), &info), "");
        std::vector<uint8_t> pixels(static_cast<size_t>(info.height * info.width * 3));
        ASSERT_EQ(image::decode(p, bytes.size(), info, pixels.data()), "");
        for (int64_t y = 0; y < info.height; ++y) {
          std::copy_n(pixels.begin() + y * info.width * 3, info.width * 3,
                      want.begin() + y * 9 * 3);
        }
      }
      EXPECT_EQ(b["images_size"][r][k][0].item<int64_t>(), real ? info.height : 0);
      EXPECT_EQ(b["images_size"][r][k][1].item<int64_t>(), real ? info.width : 0);
      const at::Tensor got = b["images"][r][k].contiguous();
      EXPECT_EQ(
          std::vector<uint8_t>(got.data_ptr<uint8_t>(), got.data_ptr<uint8_t>() + want.size()),
          want)
          << "sequence " << r << " image " << k;
    }
  }
  EXPECT_EQ(b.strings.at("source"), (std::vector<std::string>(4, "seq")));
}

TEST(Multimodal, BadPositionsAndUndecodableImagesAreRefusedNamingRecordAndField) {
  TempDir dir;
  RecordDatasetWriter writer(dir.path() / "mm", multimodal_schema(),
                             {.layout = RecordLayout::kMultimodal});
  const std::string png = image::encode_png(pattern(2, 2, 3, 0).data(), 2, 2, 3);
  writer.add(sequence_record({{1, 2}, {png}, {1}}));
  auto refused = [&](const Sequence& s) {
    return error_of<InvalidArgument>([&] { writer.add(sequence_record(s)); });
  };
  EXPECT_EQ(refused({{1, 2}, {png}, {}}),
            "record 1: field 'image_positions' holds 0 positions but field 'images' holds 1 "
            "images; give one position per image");
  EXPECT_EQ(refused({{1, 2}, {png, png}, {2, 1}}),
            "record 1: field 'image_positions' entry 1 is 1; positions must be non-decreasing and "
            "at most the 2 tokens");
  EXPECT_EQ(refused({{1}, {png}, {2}}),
            "record 1: field 'image_positions' entry 0 is 2; positions must be non-decreasing and "
            "at most the 1 tokens");
  std::string broken = png;
  broken.resize(broken.size() - 20);
  const std::string error = refused({{1}, {png, broken}, {0, 1}});
  EXPECT_EQ(error.rfind("record 1: field 'images': image 1: ", 0), 0u) << error;
  EXPECT_EQ(refused({{1}, {"<html>"}, {0}}),
            "record 1: field 'images': image 0: not a PNG, JPEG or Loom raw image (first bytes "
            "3c 68 74 6d)");
  EXPECT_EQ(writer.records_written(), 1u);
}

TEST(Images, ChannelsMustAgreeInABatchOrAreConverted) {
  TempDir dir;
  const fs::path ds = dir.path() / "img";
  RecordDatasetWriter writer(ds, {{"image", FieldType::kImage}, {"label", FieldType::kInt}});
  const std::vector<uint8_t> gray = pattern(2, 3, 1, 0), rgba = pattern(2, 2, 4, 1);
  writer.add(Record().image(image::encode_png(gray.data(), 2, 3, 1)).integer(0));
  writer.add(Record().image(image::encode_png(rgba.data(), 2, 2, 4)).integer(1));
  writer.finish();
  EXPECT_EQ(error_of<InvalidArgument>([&] {
              Reader(ds, {.prefetch = 0}).read({0, 1});
            }),
            "image field 'image' has images of 1 and 4 channels within one batch (samples 0 and "
            "1); set ReaderOptions::image_channels (--image-channels) to convert them");
  const Batch b = Reader(ds, {.image_channels = 3, .prefetch = 0}).read({0, 1});
  EXPECT_EQ(b["image"].sizes(), (std::vector<int64_t>{2, 2, 3, 3}));
  EXPECT_TRUE(at::equal(b["image_size"], at::tensor({2, 3, 2, 2}, at::kLong).reshape({2, 2})));
  for (int64_t y = 0; y < 2; ++y) {
    for (int64_t x = 0; x < 3; ++x) {
      for (int64_t k = 0; k < 3; ++k) {
        EXPECT_EQ(b["image"][0][y][x][k].item<uint8_t>(), gray[y * 3 + x]);  // replicated
        const uint8_t want = x < 2 ? rgba[(y * 2 + x) * 4 + k] : 0;          // alpha dropped
        EXPECT_EQ(b["image"][1][y][x][k].item<uint8_t>(), want);
      }
    }
  }
}

TEST(Images, ConvertChannelsFollowsTheStatedRules) {
  const uint8_t rgba[] = {10, 200, 30, 40};
  const uint8_t luma = (299 * 10 + 587 * 200 + 114 * 30 + 500) / 1000;
  auto convert = [](const uint8_t* in, int64_t from, int64_t to) {
    std::vector<uint8_t> out(static_cast<size_t>(to));
    collate::convert_channels(in, from, out.data(), to, 1);
    return out;
  };
  EXPECT_EQ(convert(rgba, 4, 1), (std::vector<uint8_t>{luma}));
  EXPECT_EQ(convert(rgba, 4, 2), (std::vector<uint8_t>{luma, 40}));
  EXPECT_EQ(convert(rgba, 4, 3), (std::vector<uint8_t>{10, 200, 30}));
  EXPECT_EQ(convert(rgba, 3, 4), (std::vector<uint8_t>{10, 200, 30, 255}));
  EXPECT_EQ(convert(rgba, 3, 2), (std::vector<uint8_t>{luma, 255}));
  EXPECT_EQ(convert(rgba, 1, 3), (std::vector<uint8_t>{10, 10, 10}));
  EXPECT_EQ(convert(rgba, 2, 4), (std::vector<uint8_t>{10, 10, 10, 200}));
  EXPECT_EQ(convert(rgba, 1, 4), (std::vector<uint8_t>{10, 10, 10, 255}));
}

}  // namespace
}  // namespace loom::data
