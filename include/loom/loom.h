// The umbrella header: everything a Loom user needs.
#pragma once

#include "loom/comm/store.h"
#include "loom/config.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/data/sampler.h"
#include "loom/data/vocabulary.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/metrics/flops.h"
#include "loom/metrics/goodput.h"
#include "loom/metrics/logger.h"
#include "loom/metrics/memory.h"
#include "loom/metrics/step_timer.h"
#include "loom/runtime.h"
#include "loom/train/schedule.h"
#include "loom/version.h"
