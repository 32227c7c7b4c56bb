// DeviceMesh: row-major coordinates, one subgroup per dimension, and the pp x dp x tp config.
#include "loom/parallel/mesh.h"

#include <set>

#include "loom/error.h"

namespace loom::parallel {

namespace {

int product(const std::vector<MeshDim>& dims) {
  int n = 1;
  for (const MeshDim& d : dims) n *= d.size;
  return n;
}

std::string describe_dims(const std::vector<MeshDim>& dims) {
  std::string out;
  for (const MeshDim& d : dims) {
    if (!out.empty()) out += " x ";
    out += d.name + "=" + std::to_string(d.size);
  }
  return out.empty() ? "(no dimensions)" : out;
}

void check_dims(const std::vector<MeshDim>& dims, int world_size) {
  std::set<std::string> names;
  for (const MeshDim& d : dims) {
    LOOM_CHECK(!d.name.empty(), InvalidArgument, "DeviceMesh ", describe_dims(dims),
               ": a dimension has no name; name every dimension (e.g. \"dp\", \"tp\")");
    LOOM_CHECK(names.insert(d.name).second, InvalidArgument, "DeviceMesh ", describe_dims(dims),
               ": dimension '", d.name, "' appears twice; give each dimension its own name");
    LOOM_CHECK(d.size >= 1, InvalidArgument, "DeviceMesh ", describe_dims(dims), ": dimension '",
               d.name, "' has size ", d.size, "; every size must be at least 1");
  }
  LOOM_CHECK(product(dims) == world_size, InvalidArgument, "DeviceMesh ", describe_dims(dims),
             " has ", product(dims), " ranks but the world has ", world_size,
             "; choose sizes whose product is ", world_size);
}

}  // namespace

DeviceMesh::DeviceMesh(comm::Group& world, std::vector<MeshDim> dims)
    : world_(world), dims_(std::move(dims)) {
  check_dims(dims_, world.size());
  // Row-major: the last dimension's coordinate changes fastest.
  int rest = world.rank();
  coordinates_.assign(dims_.size(), 0);
  for (size_t d = dims_.size(); d-- > 0;) {
    coordinates_[d] = rest % dims_[d].size;
    rest /= dims_[d].size;
  }
  // Every rank creates its groups in the same dimension order, so each subgroup's members
  // make the same calls in the same order (comm::Group::new_subgroup's contract).
  for (size_t d = 0; d < dims_.size(); ++d) {
    std::vector<int> ranks;
    std::vector<int> c = coordinates_;
    for (int i = 0; i < dims_[d].size; ++i) {
      c[d] = i;
      ranks.push_back(rank_at(c));
    }
    groups_.push_back(world.new_subgroup(ranks));
  }
}

DeviceMesh::~DeviceMesh() = default;

size_t DeviceMesh::index_of(const std::string& dim) const {
  for (size_t d = 0; d < dims_.size(); ++d) {
    if (dims_[d].name == dim) return d;
  }
  throw InvalidArgument(detail::concat("DeviceMesh ", describe(), " has no dimension '", dim,
                                       "'; use one of its dimension names"));
}

int DeviceMesh::size(const std::string& dim) const { return dims_[index_of(dim)].size; }

int DeviceMesh::coordinate(const std::string& dim) const { return coordinates_[index_of(dim)]; }

comm::Group& DeviceMesh::group(const std::string& dim) const { return *groups_[index_of(dim)]; }

int DeviceMesh::rank_at(const std::vector<int>& coordinates) const {
  LOOM_CHECK(coordinates.size() == dims_.size(), InvalidArgument, "DeviceMesh ", describe(), ": ",
             coordinates.size(), " coordinates given for ", dims_.size(), " dimensions");
  int rank = 0;
  for (size_t d = 0; d < dims_.size(); ++d) {
    LOOM_CHECK(coordinates[d] >= 0 && coordinates[d] < dims_[d].size, InvalidArgument,
               "DeviceMesh ", describe(), ": coordinate ", coordinates[d], " of '", dims_[d].name,
               "' is outside [0, ", dims_[d].size, ")");
    rank = rank * dims_[d].size + coordinates[d];
  }
  return rank;
}

std::string DeviceMesh::describe() const { return describe_dims(dims_); }

ConfigSchema mesh_schema() {
  ConfigSchema s;
  s.add("parallel.pp", 1, "pipeline-parallel stages (the outermost mesh dimension)");
  s.add("parallel.dp", 0,
        "data-parallel replicas; 0 takes the ranks pp and tp leave (world / (pp * tp))");
  s.add("parallel.tp", 1, "tensor-parallel ranks per stage (the innermost mesh dimension)");
  return s;
}

std::unique_ptr<DeviceMesh> mesh_from(comm::Group& world, const Config& config) {
  const int64_t pp = config.get<int64_t>("parallel.pp");
  const int64_t tp = config.get<int64_t>("parallel.tp");
  int64_t dp = config.get<int64_t>("parallel.dp");
  const int64_t n = world.size();
  LOOM_CHECK(pp >= 1 && tp >= 1 && dp >= 0, ConfigError, "parallel.pp is ", pp, ", parallel.tp is ",
             tp, " and parallel.dp is ", dp,
             "; pp and tp must be at least 1 and dp at least 0 (0: the rest)");
  if (dp == 0) {
    LOOM_CHECK(n % (pp * tp) == 0, ConfigError, "parallel.pp = ", pp, " times parallel.tp = ", tp,
               " is ", pp * tp, ", which does not divide the world size ", n,
               "; choose pp and tp whose product divides ", n);
    dp = n / (pp * tp);
  }
  LOOM_CHECK(pp * dp * tp == n, ConfigError, "parallel.pp = ", pp, " x parallel.dp = ", dp,
             " x parallel.tp = ", tp, " is ", pp * dp * tp, " ranks but the world has ", n,
             "; choose sizes whose product is ", n, " (or parallel.dp = 0)");
  return std::make_unique<DeviceMesh>(world, std::vector<MeshDim>{{"pp", static_cast<int>(pp)},
                                                                  {"dp", static_cast<int>(dp)},
                                                                  {"tp", static_cast<int>(tp)}});
}

}  // namespace loom::parallel
