// The safetensors file format (huggingface/safetensors, "Format"): an 8-byte little-endian
// header length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]},
// "__metadata__": {string: string}}, then the tensors' raw little-endian bytes, offsets
// relative to the end of the header. Private to Loom; include/loom/ckpt/export.h is the API.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "loom/ckpt/export.h"

namespace loom::ckpt {

// Writes the tensors in the order given, with no gaps; the header is padded with spaces to a
// multiple of 8 bytes, as the reference writer does. InvalidArgument for a dtype safetensors
// has no name for (complex) and for a name used twice or "__metadata__".
void write_safetensors(const std::filesystem::path& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata);

// The tensors in the header's order of offsets. Every claim of the header is checked against
// the file before anything is allocated for it: CorruptData naming the file for a file
// shorter than its header, a header length beyond the file (or over 100 MB, the reference
// reader's limit), JSON that is not a header, an unknown dtype, a shape whose bytes disagree
// with its offsets, offsets outside the file. A missing file is IoError.
std::vector<NamedTensor> read_safetensors(const std::filesystem::path& path,
                                          std::map<std::string, std::string>* metadata = nullptr);

}  // namespace loom::ckpt
