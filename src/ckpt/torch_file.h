// torch.save files: a zip archive holding data.pkl (a pickle, protocol 2) and one record per
// tensor storage (data/<key>). Writing goes through libtorch's torch::pickle_save (a plain dict
// of tensors, which Python's torch.load reads). Reading is Loom's own: libtorch's unpickler
// turns the collections.OrderedDict every state_dict() is into None, so it cannot read what
// PyTorch users save. Private to Loom; include/loom/ckpt/export.h is the API.
#pragma once

#include <filesystem>
#include <vector>

#include "loom/ckpt/export.h"

namespace loom::ckpt {

// Writes a dict name -> tensor, in order, atomically. InvalidArgument for a name used twice.
void write_torch_file(const std::filesystem::path& path, const std::vector<NamedTensor>& tensors);

// Reads a torch.save'd dict (or OrderedDict, e.g. a state_dict()) of tensors, in the dict's
// order. The pickle may use what torch.save writes for such a dict (storages by persistent
// id, _rebuild_tensor_v2, _rebuild_parameter, an OrderedDict's _metadata, which is dropped)
// and nothing else: other objects, a value that is not a tensor, a storage record missing or
// shorter than its tensor, a zip that is not one are CorruptData naming the file.
std::vector<NamedTensor> read_torch_file(const std::filesystem::path& path);

}  // namespace loom::ckpt
