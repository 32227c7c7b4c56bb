// Names the calling thread (what top -H, gdb and traces show). Private to Loom.
#pragma once

#include <pthread.h>

#include <string>

namespace loom::util {

// Linux keeps 15 bytes of a thread's name; longer names are cut.
inline void name_this_thread(const std::string& name) {
  ::pthread_setname_np(::pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace loom::util
