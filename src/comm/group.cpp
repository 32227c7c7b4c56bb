// Backend-independent pieces of comm::Group: ReduceOp names, shard_range, and the tensor checks
// every backend runs before it enqueues an op.

#include "loom/comm/group.h"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <utility>

#include "comm/group_internal.h"
#include "loom/error.h"
#include "loom/metrics/trace.h"
#include "util/dtype.h"

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

constexpr const char* kSupportedDtypes =
    "float32, float64, bfloat16, float16, int32, int64 or uint8";

std::string device_word(const at::Device& device) {
  return device.is_cpu() ? std::string("CPU") : device.str();
}

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

std::string shape_string(const at::Tensor& tensor) {
  std::string out = "[";
  for (size_t i = 0; i < static_cast<size_t>(tensor.dim()); ++i) {
    out += (i == 0 ? "" : ", ") + std::to_string(tensor.size(static_cast<int64_t>(i)));
  }
  return out + "]";
}

bool is_integral(at::ScalarType dtype) { return at::isIntegralType(dtype, /*includeBool=*/true); }

std::string rank_list(const std::vector<int>& ranks, const char* separator) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += (i == 0 ? "" : separator) + std::to_string(ranks[i]);
  }
  return out;
}

void check_tensor(const char* op, const char* what, const at::Tensor& tensor,
                  const at::Device& device) {
  LOOM_CHECK(tensor.defined(), InvalidArgument, op, ": ", what,
             " is an undefined tensor; expected a defined, ", device_word(device),
             ", contiguous tensor of ", kSupportedDtypes);
  const bool ok = tensor.device() == device && tensor.is_contiguous() && !tensor.is_sparse() &&
                  is_supported(tensor.scalar_type());
  LOOM_CHECK(ok, InvalidArgument, op, ": ", what, " has dtype ",
             util::dtype_name(tensor.scalar_type()), ", shape ", shape_string(tensor), ", device ",
             tensor.device().str(), tensor.is_contiguous() ? "" : ", non-contiguous",
             "; expected a defined, ", device_word(device), ", contiguous tensor of ",
             kSupportedDtypes);
}

void check_same_dtype(const char* op, const char* what, const at::Tensor& tensor,
                      const char* reference_what, const at::Tensor& reference) {
  LOOM_CHECK(tensor.scalar_type() == reference.scalar_type(), InvalidArgument, op, ": ", what,
             " has dtype ", util::dtype_name(tensor.scalar_type()), " (shape ",
             shape_string(tensor), ") but ", reference_what, " has dtype ",
             util::dtype_name(reference.scalar_type()), "; expected the same dtype");
}

void check_numel(const char* op, const char* what, const at::Tensor& tensor, int64_t expected) {
  LOOM_CHECK(tensor.numel() == expected, InvalidArgument, op, ": ", what, " has ", tensor.numel(),
             " elements (dtype ", util::dtype_name(tensor.scalar_type()), ", shape ",
             shape_string(tensor), "); expected ", expected);
}

void check_rank(const char* op, const char* what, int rank, int size) {
  LOOM_CHECK(rank >= 0 && rank < size, InvalidArgument, op, ": ", what, " ", rank,
             " is not a rank of the group; expected one in [0, ", size, ")");
}

void check_reduce_op(const char* op, ReduceOp reduce, at::ScalarType dtype) {
  LOOM_CHECK(!(reduce == ReduceOp::kAvg && is_integral(dtype)), InvalidArgument, op,
             ": ReduceOp avg is not supported for integer dtype ", util::dtype_name(dtype),
             " (a truncated mean would silently lose information); reduce with sum and divide, "
             "or use a floating-point dtype");
}

void check_same_dtype_list(const char* op, const std::vector<at::Tensor>& tensors,
                           const at::Device& device) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string what = "tensors[" + std::to_string(i) + "]";
    check_tensor(op, what.c_str(), tensors[i], device);
    check_same_dtype(op, what.c_str(), tensors[i], "tensors[0]", tensors[0]);
  }
}

// --- whole ops ---------------------------------------------------------------------------------

void check_all_reduce(const OpPlace& place, const at::Tensor& tensor, ReduceOp op) {
  check_tensor("all_reduce", "tensor", tensor, place.device);
  check_reduce_op("all_reduce", op, tensor.scalar_type());
}

void check_all_reduce_coalesced(const OpPlace& place, const std::vector<at::Tensor>& tensors,
                                ReduceOp op) {
  LOOM_CHECK(!tensors.empty(), InvalidArgument,
             "all_reduce_coalesced: tensors is empty; expected at least one tensor");
  check_same_dtype_list("all_reduce_coalesced", tensors, place.device);
  check_reduce_op("all_reduce_coalesced", op, tensors[0].scalar_type());
}

void check_reduce_scatter(const OpPlace& place, const at::Tensor& output, const at::Tensor& input,
                          ReduceOp op) {
  check_tensor("reduce_scatter", "input", input, place.device);
  check_tensor("reduce_scatter", "output", output, place.device);
  check_same_dtype("reduce_scatter", "output", output, "input", input);
  check_reduce_op("reduce_scatter", op, input.scalar_type());
  check_numel("reduce_scatter", "output", output,
              shard_range(input.numel(), place.size, place.rank).size());
}

void check_all_gather(const OpPlace& place, const at::Tensor& output, const at::Tensor& input) {
  check_tensor("all_gather", "input", input, place.device);
  check_tensor("all_gather", "output", output, place.device);
  check_same_dtype("all_gather", "output", output, "input", input);
  check_numel("all_gather", "output", output, input.numel() * place.size);
}

void check_all_gather(const OpPlace& place, const std::vector<at::Tensor>& outputs,
                      const at::Tensor& input) {
  check_tensor("all_gather", "input", input, place.device);
  LOOM_CHECK(static_cast<int>(outputs.size()) == place.size, InvalidArgument,
             "all_gather: outputs has ", outputs.size(), " tensors; expected one per rank (",
             place.size, ")");
  for (size_t r = 0; r < outputs.size(); ++r) {
    const std::string what = detail::concat("outputs[", r, "]");
    check_tensor("all_gather", what.c_str(), outputs[r], place.device);
    check_same_dtype("all_gather", what.c_str(), outputs[r], "input", input);
    check_numel("all_gather", what.c_str(), outputs[r], input.numel());
  }
}

void check_broadcast(const OpPlace& place, const at::Tensor& tensor, int root) {
  check_tensor("broadcast", "tensor", tensor, place.device);
  check_rank("broadcast", "root", root, place.size);
}

void check_send_recv(const OpPlace& place, const char* op, const at::Tensor& tensor, int peer,
                     int tag) {
  const bool is_send = std::string(op) == "send";
  check_tensor(op, "tensor", tensor, place.device);
  check_rank(op, is_send ? "dst" : "src", peer, place.size);
  LOOM_CHECK(peer != place.rank, InvalidArgument, op, ": ", is_send ? "dst" : "src", " ", peer,
             " is this rank; send and recv need another rank of the group");
  LOOM_CHECK(tag >= 0, InvalidArgument, op, ": tag must be >= 0, got ", tag);
}

std::vector<int> check_subgroup_ranks(const OpPlace& place, const std::vector<int>& ranks) {
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  const std::string listed = "[" + rank_list(sorted, ",") + "]";
  for (size_t i = 0; i < sorted.size(); ++i) {
    check_rank("new_subgroup", "listed rank", sorted[i], place.size);
    LOOM_CHECK(i == 0 || sorted[i] != sorted[i - 1], InvalidArgument, "new_subgroup: rank ",
               sorted[i], " is listed twice in ", listed);
  }
  LOOM_CHECK(std::find(sorted.begin(), sorted.end(), place.rank) != sorted.end(), InvalidArgument,
             "new_subgroup: this rank (", place.rank, ") is not among the listed ranks ", listed,
             "; only listed ranks may call it");
  return sorted;
}

void check_new_group(const char* function, int rank, int size, const std::string& name,
                     std::chrono::milliseconds connect_timeout) {
  LOOM_CHECK(size > 0, InvalidArgument, function, ": size must be positive, got ", size);
  check_rank(function, "rank", rank, size);
  LOOM_CHECK(!name.empty(), InvalidArgument, function, ": options.name is empty");
  LOOM_CHECK(connect_timeout.count() > 0, InvalidArgument, function,
             ": connect_timeout must be positive, got ", connect_timeout.count(), " ms");
}

std::string fresh_store_prefix(Store& store, const std::string& base, int rank) {
  const int64_t generation = store.add(detail::concat(base, "/creations/rank", rank), 1);
  return detail::concat(base, "#", generation);
}

// --- GroupState --------------------------------------------------------------------------------

GroupState::GroupState(int rank_, int size_, std::string name_, std::filesystem::path dump_dir_,
                       size_t flight_capacity)
    : rank(rank_),
      size(size_),
      name(std::move(name_)),
      dump_dir(std::move(dump_dir_)),
      description(detail::concat("'", name, "' (rank ", rank, " of ", size, ")")),
      recorder(flight_capacity) {}

bool GroupState::mark_broken(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!broken_.empty()) return false;
  broken_ = why.empty() ? std::string("broken") : why;
  return true;
}

std::string GroupState::broken_reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return broken_;
}

std::string collective_trace_args(const GroupState& state, uint64_t sequence,
                                  const std::string& dtype, int64_t numel,
                                  const std::vector<int>& peers) {
  const std::optional<c10::ScalarType> type = util::dtype_of(dtype);
  const int64_t bytes = type ? numel * static_cast<int64_t>(c10::elementSize(*type)) : 0;
  return nlohmann::json{{"group", state.name}, {"sequence", sequence}, {"dtype", dtype},
                        {"numel", numel},      {"bytes", bytes},       {"peers", peers}}
      .dump();
}

void trace_collective(const std::string& op, int64_t start_us, std::string args, bool failed) {
  if (start_us < 0) return;
  metrics::trace_span("collective", failed ? op + " (failed)" : op, start_us,
                      metrics::trace_now_us(), std::move(args));
}

std::string GroupState::dump_flight() const noexcept {
  if (dump_dir.empty()) return "";
  try {
    const std::filesystem::path file = dump_dir / detail::concat("rank_", rank, ".json");
    try {
      recorder.dump(file, rank, name);
      return detail::concat("Flight recorder dumped to ", file.string(), ".");
    } catch (const std::exception& e) {
      return detail::concat("Writing the flight recorder dump ", file.string(),
                            " failed: ", e.what());
    }
  } catch (...) {
    return "";
  }
}

std::vector<std::vector<std::string>> all_gather_lines(Group& group, const std::string& text,
                                                       at::Device device,
                                                       std::chrono::milliseconds timeout) {
  const int world = group.size();
  const auto on = [&](at::ScalarType dtype) { return at::TensorOptions(dtype).device(device); };
  at::Tensor length = at::full({1}, static_cast<int64_t>(text.size()), at::kLong).to(device);
  at::Tensor lengths = at::empty({world}, on(at::kLong));
  group.all_gather(lengths, length, {timeout})->wait(timeout);
  lengths = lengths.cpu();
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  bytes = bytes.to(device);
  at::Tensor all = at::empty({world * longest}, on(at::kByte));
  group.all_gather(all, bytes, {timeout})->wait(timeout);
  all = all.cpu();
  std::vector<std::vector<std::string>> out(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    std::istringstream in(std::string(static_cast<const char*>(all.data_ptr()) + r * longest,
                                      static_cast<size_t>(lengths[r].item<int64_t>())));
    for (std::string line; std::getline(in, line);) out[static_cast<size_t>(r)].push_back(line);
  }
  return out;
}

}  // namespace internal
}  // namespace loom::comm
