// The umbrella header: everything a Loom user needs.
#pragma once

#include "loom/ckpt/checkpointer.h"
#include "loom/ckpt/state.h"
#include "loom/comm/store.h"
#include "loom/config.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/runtime.h"
#include "loom/version.h"
