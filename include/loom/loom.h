// The umbrella header: everything a Loom user needs.
#pragma once

#include "loom/comm/gloo.h"
#include "loom/comm/group.h"
#include "loom/comm/store.h"
#include "loom/config.h"
#include "loom/data/dataset.h"
#include "loom/data/reader.h"
#include "loom/data/sampler.h"
#include "loom/data/vocabulary.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/optim.h"
#include "loom/parallel/zero.h"
#include "loom/runtime.h"
#include "loom/version.h"
