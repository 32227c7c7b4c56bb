// Host staging memory and device-to-host copies for the checkpointer. CUDA builds compile
// device_copy_cuda.cpp (pinned memory, a side stream, an event); others device_copy_none.cpp
// (plain page-aligned memory; a CUDA tensor cannot exist there, so nothing stages one).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <memory>

namespace loom::ckpt::internal {

// Page-aligned (4096) host memory, page-locked for DMA when made with pinned = true in a CUDA
// build (a CPU build, or a machine whose driver refuses, gets ordinary memory). Move-only.
class HostBuffer {
 public:
  HostBuffer() = default;
  // Throws IoError naming the size when the allocation fails.
  HostBuffer(size_t bytes, bool pinned);
  ~HostBuffer();
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  bool pinned() const { return pinned_; }

 private:
  void release();

  char* data_ = nullptr;
  size_t size_ = 0;
  bool pinned_ = false;
};

// The end of a batch of device-to-host copies: a CUDA event recorded on the side stream.
class CopyFence {
 public:
  virtual ~CopyFence() = default;
  // Later work on the device's current (compute) stream waits for the copies; the host does
  // not wait. After this the caller may change the copied tensors.
  virtual void order_compute_stream() = 0;
  // Blocks the calling thread until the copies finished. Throws IoError on a CUDA error.
  virtual void wait() = 0;
};

// Device-to-host copies on a side stream of one CUDA device, created at the first copy.
// Thread safety: one thread at a time (the checkpointer's training thread).
class DeviceStager {
 public:
  virtual ~DeviceStager() = default;
  // Enqueues src (a CUDA tensor; non-contiguous ones are made contiguous on the compute stream
  // first) into dst[0, nbytes) on the side stream, after the work queued so far on the current
  // stream. Returns at once; src stays referenced until the fence that follows has passed.
  virtual void copy_to_host(const at::Tensor& src, char* dst) = 0;
  // Records the fence after every copy enqueued so far.
  virtual std::shared_ptr<CopyFence> fence() = 0;
};

// Throws InvalidArgument in a build without CUDA.
std::unique_ptr<DeviceStager> new_device_stager();

}  // namespace loom::ckpt::internal
