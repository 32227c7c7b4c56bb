// Reads the IDX files Fashion-MNIST ships as (gzip-compressed or plain).
#pragma once

#include <torch/torch.h>

#include <filesystem>

namespace fashion_mnist {

// images: uint8 [N, 28, 28]; labels: int64 [N]. A missing, truncated or mislabelled file is a
// loom::IoError or loom::CorruptData naming it.
torch::Tensor read_images(const std::filesystem::path& path);
torch::Tensor read_labels(const std::filesystem::path& path);

}  // namespace fashion_mnist
