// device_copy.h with CUDA: pinned staging memory (cudaHostAlloc), copies on a non-blocking side
// stream ordered after the compute stream by an event, and a fence event at the end.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <vector>

#include "ckpt/device_copy.h"
#include "ckpt/host_pages.h"
#include "comm/cuda_stream.h"
#include "loom/error.h"

namespace loom::ckpt::internal {
namespace {

constexpr size_t kAlignment = 4096;

void check_cuda(cudaError_t error, const char* what) {
  LOOM_CHECK(error == cudaSuccess, IoError, "checkpoint staging: ", what,
             " failed: ", cudaGetErrorString(error));
}

// Owns one CUDA event.
class Event {
 public:
  Event() {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class CudaFence final : public CopyFence {
 public:
  CudaFence(int device, cudaStream_t side, std::vector<at::Tensor> sources)
      : device_(device), sources_(std::move(sources)) {
    check_cuda(cudaEventRecord(done_.get(), side), "cudaEventRecord");
  }

  void order_compute_stream() override {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    check_cuda(cudaStreamWaitEvent(comm::current_compute_stream(device_), done_.get(), 0),
               "cudaStreamWaitEvent");
  }

  void wait() override {
    check_cuda(cudaEventSynchronize(done_.get()), "the device-to-host copies");
    sources_.clear();
  }

 private:
  // Constant after construction.
  const int device_;
  Event done_;
  // Touched only by wait()'s caller (the writer thread) once the fence is shared.
  std::vector<at::Tensor> sources_;  // kept alive until the copies finished
};

class CudaStager final : public DeviceStager {
 public:
  ~CudaStager() override {
    if (side_ != nullptr) cudaStreamDestroy(side_);
  }

  void copy_to_host(const at::Tensor& src, char* dst) override {
    const int device = src.get_device();
    if (side_ == nullptr) {
      device_ = device;
      check_cuda(cudaSetDevice(device), "cudaSetDevice");
      check_cuda(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate");
    }
    LOOM_CHECK(device == device_, InvalidArgument, "checkpoint: tensors on cuda:", device_,
               " and cuda:", device, " in one state; a rank saves the tensors of one GPU");
    const at::Tensor contiguous = src.contiguous();  // on the compute stream, before `ready`
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    Event ready;
    check_cuda(cudaEventRecord(ready.get(), comm::current_compute_stream(device)),
               "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(side_, ready.get(), 0), "cudaStreamWaitEvent");
    check_cuda(cudaMemcpyAsync(dst, contiguous.data_ptr(), contiguous.nbytes(),
                               cudaMemcpyDeviceToHost, side_),
               "cudaMemcpyAsync (device to host)");
    sources_.push_back(contiguous);
  }

  std::shared_ptr<CopyFence> fence() override {
    if (side_ == nullptr) return nullptr;
    auto fence = std::make_shared<CudaFence>(device_, side_, std::move(sources_));
    sources_.clear();
    return fence;
  }

 private:
  int device_ = -1;
  cudaStream_t side_ = nullptr;  // created at the first copy, on device_
  std::vector<at::Tensor> sources_;
};

}  // namespace

HostBuffer::HostBuffer(size_t bytes, bool pinned) {
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  // cudaHostAlloc memory is page-aligned, which O_DIRECT writes need.
  if (pinned && cudaHostAlloc(reinterpret_cast<void**>(&data_), rounded, cudaHostAllocDefault) ==
                    cudaSuccess) {
    pinned_ = true;
  } else {
    cudaGetLastError();  // a refused pin is not an error: ordinary memory still works
    data_ = allocate_pages(rounded);
  }
  LOOM_CHECK(data_ != nullptr, IoError, "cannot allocate ", rounded,
             " bytes of checkpoint staging memory");
  size_ = rounded;
}

void HostBuffer::release() {
  if (pinned_) {
    cudaFreeHost(data_);
  } else {
    std::free(data_);
  }
  data_ = nullptr;
  size_ = 0;
  pinned_ = false;
}

HostBuffer::~HostBuffer() { release(); }

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : data_(other.data_), size_(other.size_), pinned_(other.pinned_) {
  other.data_ = nullptr;
  other.size_ = 0;
  other.pinned_ = false;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    size_ = other.size_;
    pinned_ = other.pinned_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.pinned_ = false;
  }
  return *this;
}

std::unique_ptr<DeviceStager> new_device_stager() { return std::make_unique<CudaStager>(); }

}  // namespace loom::ckpt::internal
