// Backend-independent helpers for comm::Group implementations (defined in group.cpp): tensor
// validation with messages that name the op, dtype and shape, and dtype names for flight dumps.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "loom/comm/group.h"

namespace loom::comm::internal {

// "float32", "bfloat16", "int64", ... (torch's own name for dtypes Loom does not support).
std::string dtype_name(at::ScalarType dtype);
// "[2, 3]".
std::string shape_string(const at::Tensor& tensor);
bool is_integral(at::ScalarType dtype);

// Throws InvalidArgument unless `tensor` is a defined, CPU, contiguous tensor of a supported
// dtype. `what` names the argument ("tensor", "outputs[2]"); `op` the collective.
void check_tensor(const char* op, const char* what, const at::Tensor& tensor);
// Throws InvalidArgument unless both tensors have the same dtype.
void check_same_dtype(const char* op, const char* what, const at::Tensor& tensor,
                      const char* reference_what, const at::Tensor& reference);
// Throws InvalidArgument unless tensor.numel() == expected.
void check_numel(const char* op, const char* what, const at::Tensor& tensor, int64_t expected);
// Throws InvalidArgument unless 0 <= rank < size; `what` names it ("root", "dst").
void check_rank(const char* op, const char* what, int rank, int size);
// kAvg of integers is rejected (InvalidArgument): a truncated mean silently loses information.
void check_reduce_op(const char* op, ReduceOp reduce, at::ScalarType dtype);
// Checks every tensor (check_tensor) and that they share the first one's dtype.
void check_same_dtype_list(const char* op, const std::vector<at::Tensor>& tensors);

}  // namespace loom::comm::internal
