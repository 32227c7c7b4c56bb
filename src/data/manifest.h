// manifest.json of a dataset: the content identity its version hashes, writing the current
// format and reading every older one (docs/datasets.md, "Format versions"). Private to Loom;
// read_manifest and check_tokenizer_files are public in loom/data/dataset.h.
#pragma once

#include <filesystem>
#include <string>

#include "loom/data/dataset.h"

namespace loom::data::format {

// The dataset's content version: xxHash64 of its content identity (kind, description, shards
// with sizes, hashes and counts, vocabulary or schema, tokenizer files), serialized as format 1
// serialized its whole manifest, so that format 1 versions stay what they were.
std::string content_version(const Manifest& m);

// Parses and checks the text of a manifest.json, named `name` in errors (a path or a URL):
// what read_manifest does once it has read the file.
Manifest parse_manifest_text(const std::string& text, const std::string& name);

// Writes `m` as a current-format manifest.json into `dir`, atomically and durably (the
// directory is fsynced first, so the shards it names are durable before it). Sets
// m.format_version and m.version; keeps m.previous_version. IoError naming the file.
void write_manifest(const std::filesystem::path& dir, Manifest& m);

// The FileInfo of `dir`/`name`: its size and xxHash64. IoError when it cannot be read.
FileInfo describe_file(const std::filesystem::path& dir, const std::string& name);

// Checks that `dir`/f.file exists with f's size and hash: IoError when missing, CorruptData
// naming it (as `role`, e.g. "tokenizer file") otherwise.
void check_file(const std::filesystem::path& dir, const FileInfo& f, const char* role);

}  // namespace loom::data::format
