// device_copy.h without CUDA: ordinary page-aligned memory and no device copies.
#include <cstdlib>

#include "ckpt/device_copy.h"
#include "ckpt/host_pages.h"
#include "loom/error.h"

namespace loom::ckpt::internal {
namespace {

constexpr size_t kAlignment = 4096;

}  // namespace

HostBuffer::HostBuffer(size_t bytes, bool /*pinned: no CUDA to pin with*/) {
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  data_ = allocate_pages(rounded);
  LOOM_CHECK(data_ != nullptr, IoError, "cannot allocate ", rounded,
             " bytes of checkpoint staging memory");
  size_ = rounded;
}

void HostBuffer::release() {
  std::free(data_);
  data_ = nullptr;
  size_ = 0;
}

HostBuffer::~HostBuffer() { release(); }

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : data_(other.data_), size_(other.size_), pinned_(other.pinned_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    size_ = other.size_;
    pinned_ = other.pinned_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

std::unique_ptr<DeviceStager> new_device_stager() {
  throw InvalidArgument(
      "checkpoint: a tensor is on a CUDA device but this Loom was built without CUDA "
      "(LOOM_WITH_CUDA=OFF)");
}

}  // namespace loom::ckpt::internal
