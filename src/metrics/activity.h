// What the training loop is doing now, readable from any thread: the heartbeat sends it, so
// that a hung job names the phase each rank is stuck in (docs/observability.md). Private to
// Loom: metrics::StepTimer publishes it, Runtime's heartbeat reads it.
#pragma once

namespace loom::metrics {

// The innermost open phase of the step timer that changed last (its metrics::to_string name;
// "other" inside a step outside every phase), "between_steps" outside a step (evaluation,
// sampling, the end of the run), or "" before any StepTimer began a step in this process. One
// training loop per process: with several timers, the one that changed last wins.
const char* current_activity();

}  // namespace loom::metrics
