// The GPT example's configuration keys (beside Runtime's run.* and log.* keys), shared by the
// program and its config test, which loads every configs/*.toml through them.
#pragma once

#include <c10/core/ScalarType.h>
#include <loom/config.h>

namespace gpt {

// train.* (loom::train::TrainOptions), data.*, model.*, eval.* and sample.*.
loom::ConfigSchema config_schema();

// model.dtype as a torch dtype: "float32" or "bfloat16" (bf16 parameters and compute, with
// fp32 master weights in DataParallel). Anything else is ConfigError naming the key.
c10::ScalarType parameter_dtype(const loom::Config& config);

}  // namespace gpt
