// Backend-independent pieces of comm::Group: ReduceOp names, shard_range, and the tensor checks
// every backend runs before it enqueues an op.

#include "loom/comm/group.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "comm/group_internal.h"
#include "loom/error.h"

namespace loom::comm {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

ShardRange shard_range(int64_t n, int size, int rank) {
  LOOM_CHECK(n >= 0, InvalidArgument, "shard_range: n must be >= 0, got ", n);
  LOOM_CHECK(size > 0, InvalidArgument, "shard_range: size must be positive, got ", size);
  LOOM_CHECK(rank >= 0 && rank < size, InvalidArgument, "shard_range: rank ", rank,
             " is outside [0, ", size, ")");
  const int64_t chunk = (n + size - 1) / size;
  const int64_t begin = std::min(n, chunk * rank);
  return ShardRange{begin, std::min(n, begin + chunk)};
}

namespace internal {
namespace {

constexpr const char* kSupported =
    "a defined, CPU, contiguous tensor of float32, float64, bfloat16, float16, int32, int64 or "
    "uint8";

bool is_supported(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
    case at::kByte:
      return true;
    default:
      return false;
  }
}

}  // namespace

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    case at::kInt:
      return "int32";
    case at::kLong:
      return "int64";
    case at::kByte:
      return "uint8";
    default:
      return c10::toString(dtype);
  }
}

std::string shape_string(const at::Tensor& tensor) {
  std::string out = "[";
  for (size_t i = 0; i < static_cast<size_t>(tensor.dim()); ++i) {
    out += (i == 0 ? "" : ", ") + std::to_string(tensor.size(static_cast<int64_t>(i)));
  }
  return out + "]";
}

bool is_integral(at::ScalarType dtype) { return at::isIntegralType(dtype, /*includeBool=*/true); }

void check_tensor(const char* op, const char* what, const at::Tensor& tensor) {
  LOOM_CHECK(tensor.defined(), InvalidArgument, op, ": ", what,
             " is an undefined tensor; expected ", kSupported);
  const bool ok = tensor.device().is_cpu() && tensor.is_contiguous() && !tensor.is_sparse() &&
                  is_supported(tensor.scalar_type());
  LOOM_CHECK(ok, InvalidArgument, op, ": ", what, " has dtype ", dtype_name(tensor.scalar_type()),
             ", shape ", shape_string(tensor), ", device ", tensor.device().str(),
             tensor.is_contiguous() ? "" : ", non-contiguous", "; expected ", kSupported);
}

void check_same_dtype(const char* op, const char* what, const at::Tensor& tensor,
                      const char* reference_what, const at::Tensor& reference) {
  LOOM_CHECK(tensor.scalar_type() == reference.scalar_type(), InvalidArgument, op, ": ", what,
             " has dtype ", dtype_name(tensor.scalar_type()), " (shape ", shape_string(tensor),
             ") but ", reference_what, " has dtype ", dtype_name(reference.scalar_type()),
             "; expected the same dtype");
}

void check_numel(const char* op, const char* what, const at::Tensor& tensor, int64_t expected) {
  LOOM_CHECK(tensor.numel() == expected, InvalidArgument, op, ": ", what, " has ", tensor.numel(),
             " elements (dtype ", dtype_name(tensor.scalar_type()), ", shape ",
             shape_string(tensor), "); expected ", expected);
}

void check_rank(const char* op, const char* what, int rank, int size) {
  LOOM_CHECK(rank >= 0 && rank < size, InvalidArgument, op, ": ", what, " ", rank,
             " is not a rank of the group; expected one in [0, ", size, ")");
}

void check_reduce_op(const char* op, ReduceOp reduce, at::ScalarType dtype) {
  LOOM_CHECK(!(reduce == ReduceOp::kAvg && is_integral(dtype)), InvalidArgument, op,
             ": ReduceOp avg is not supported for integer dtype ", dtype_name(dtype),
             " (a truncated mean would silently lose information); reduce with sum and divide, "
             "or use a floating-point dtype");
}

void check_same_dtype_list(const char* op, const std::vector<at::Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string what = "tensors[" + std::to_string(i) + "]";
    check_tensor(op, what.c_str(), tensors[i]);
    check_same_dtype(op, what.c_str(), tensors[i], "tensors[0]", tensors[0]);
  }
}

}  // namespace internal
}  // namespace loom::comm
