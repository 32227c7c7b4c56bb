// LOOM_API marks what libloom exports. The library builds with -fvisibility=hidden: a class
// or function declared in include/loom without LOOM_API, and everything in src/ (loom::util,
// loom::internal, the private classes), stays inside libloom.so, so that programs link against
// the public API only and Loom's copies of third-party code never clash with theirs.
// LOOM_HIDDEN keeps a public class's private parts (the Impl of a pimpl) inside, too.
#pragma once

#define LOOM_API __attribute__((visibility("default")))
#define LOOM_HIDDEN __attribute__((visibility("hidden")))
