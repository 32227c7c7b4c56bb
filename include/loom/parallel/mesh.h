// parallel::DeviceMesh: the ranks of a job arranged as an N-dimensional grid with named
// dimensions (e.g. pp x dp x tp), and the group of every dimension, built once. Every
// model-parallel wrapper takes its groups from the mesh.
//
//   loom::parallel::DeviceMesh mesh(rt.world_group(), {{"dp", 2}, {"tp", 2}});
//   comm::Group& tp = mesh.group("tp");   // the 2 ranks that differ from this one only in tp
//   int replica = mesh.coordinate("dp");  // which data-parallel replica this rank is in
//
// Ranks are laid out row-major: the last dimension varies fastest, so with {{"dp", 2},
// {"tp", 2}} world ranks 0 and 1 form tp group 0 of replica 0 (torch's init_device_mesh and
// Megatron's order: tensor parallelism innermost, on the ranks nearest each other).
// Construction is collective over the world group. A DeviceMesh is not thread-safe; its
// groups follow comm::Group's contract.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "loom/comm/group.h"
#include "loom/config.h"
#include "loom/visibility.h"

namespace loom::parallel {

struct MeshDim {
  std::string name;  // unique within the mesh, e.g. "pp", "dp", "tp"
  int size = 1;      // >= 1
};

class LOOM_API DeviceMesh {
 public:
  // Collective: every rank of `world` calls it with the same dims. InvalidArgument naming the
  // numbers when the sizes do not multiply to world.size(), a size is below 1, or a name is
  // empty or repeated. `world` must outlive the mesh.
  DeviceMesh(comm::Group& world, std::vector<MeshDim> dims);
  ~DeviceMesh();
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  const std::vector<MeshDim>& dims() const { return dims_; }
  // The size of, this rank's index along, and the group of the dimension named `dim`
  // (InvalidArgument naming the mesh's dimensions when there is none). The group holds the
  // ranks whose coordinates equal this rank's in every other dimension, in order along `dim`.
  int size(const std::string& dim) const;
  int coordinate(const std::string& dim) const;
  comm::Group& group(const std::string& dim) const;

  comm::Group& world() const { return world_; }
  // This rank's coordinates, one per dimension.
  const std::vector<int>& coordinates() const { return coordinates_; }
  // The world rank at `coordinates` (one per dimension, each in range).
  int rank_at(const std::vector<int>& coordinates) const;
  // "pp=2 x dp=2 x tp=2".
  std::string describe() const;

 private:
  size_t index_of(const std::string& dim) const;

  comm::Group& world_;
  std::vector<MeshDim> dims_;
  std::vector<int> coordinates_;
  std::vector<std::unique_ptr<comm::Group>> groups_;  // one per dimension
};

// The parallel.pp, parallel.dp and parallel.tp config keys.
LOOM_API ConfigSchema mesh_schema();
// The pp x dp x tp mesh the config asks for: parallel.dp = 0 (the default) takes the ranks
// that pp and tp leave; ConfigError naming the keys and the world size when they do not fit.
LOOM_API std::unique_ptr<DeviceMesh> mesh_from(comm::Group& world, const Config& config);

}  // namespace loom::parallel
