// Collation of decoded records into a Batch: each field stacked over the rows as data/reader.h
// describes (ragged tensors padded with masks, images decoded and padded, episode returns and
// advantages). Private to Loom: data::Reader calls it for every batch of a record dataset.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/shard_format.h"
#include "loom/data/batch.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"

namespace loom::data::collate {

// One row of the batch: its record's decoded fields (views[i] is schema field i) and, for a
// transition of an episode dataset, its step (-1: the whole record) and its episode's index.
struct Row {
  const format::FieldView* views = nullptr;
  int64_t step = -1;
  uint64_t episode = 0;
};

// Names row r's record for an error ("record 3 of shard /d/records_00000.bin (byte offset
// 120)").
using WhereFn = std::function<std::string(size_t row)>;

// Adds every field of `rows` to `batch`. Errors: shapes that cannot be stacked or images of
// different channels without options.image_channels are InvalidArgument naming the samples;
// an image that does not decode, or an episode whose fields break the layout, is CorruptData
// naming the record and the field.
void records(const Manifest& manifest, const ReaderOptions& options, const std::vector<Row>& rows,
             const WhereFn& where, Batch& batch);

// Converts `pixels` HWC pixels of `from` channels to `to` channels (1, 2, 3 or 4): gray to
// color replicates, color to gray is ITU-R 601 luma (299 R + 587 G + 114 B) / 1000 rounded,
// alpha is dropped or added as 255.
void convert_channels(const uint8_t* in, int64_t from, uint8_t* out, int64_t to, int64_t pixels);

}  // namespace loom::data::collate
