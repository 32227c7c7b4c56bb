// Reading the 'optim' blob (optim_blob.h).
#include "parallel/optim_blob.h"

#include <nlohmann/json.hpp>
#include <string>

#include "loom/error.h"
#include "util/json.h"

namespace loom::parallel::internal {

int64_t read_optim_blob(const ckpt::State& source, const optim::FlatOptimizer* optimizer,
                        const char* who) {
  const auto blob = source.blobs.find("optim");
  LOOM_CHECK(blob != source.blobs.end(), InvalidArgument, who, ": the state has no 'optim' blob");
  const auto corrupt = [&](const char* why) {
    return CorruptData(
        detail::concat(who, ": the 'optim' blob is corrupt (", why, "): ", blob->second));
  };
  std::string saved_optimizer;
  int64_t saved_steps = 0;
  try {
    const nlohmann::json json = nlohmann::json::parse(blob->second);
    saved_optimizer = json.at("optimizer").get<std::string>();
    saved_steps = util::integer_field<int64_t>(json.at("step"), "step", "");
  } catch (const nlohmann::json::exception& e) {
    throw corrupt(e.what());
  } catch (const CorruptData& e) {  // a step that is not an integer (util::integer_field)
    throw corrupt(e.what());
  }
  LOOM_CHECK(optimizer == nullptr || saved_optimizer == optimizer->name(), InvalidArgument, who,
             ": the state was saved with optimizer '", saved_optimizer, "' but this one is '",
             optimizer->name(), "'");
  return saved_steps;
}

}  // namespace loom::parallel::internal
