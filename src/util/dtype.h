// Loom's one table of tensor dtype names: PyTorch's ("float32", "bfloat16", "int64", ...), the
// names checkpoint manifests, dataset schemas, flight dumps and every error message use.
// Private to Loom.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <string_view>

namespace loom::util {

// PyTorch's name of `type` ("float32"); for a type outside the table, c10's ("ComplexHalf").
std::string dtype_name(c10::ScalarType type);

// The type named `name`, or nullopt for a name outside the table.
std::optional<c10::ScalarType> dtype_of(std::string_view name);

// Whether `type` is in the table: the dtypes checkpoints and dataset tensors can hold.
bool is_named_dtype(c10::ScalarType type);

// Every name in the table, for error messages: "uint8, int8, ..., complex64 or complex128".
const std::string& dtype_names();

}  // namespace loom::util
