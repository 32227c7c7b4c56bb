// A flight-recorder dump as `loom flight diff` reads and compares it: the fuzzer's bytes are
// rank 0's dump, beside a well-formed dump of rank 1.
#include <string>

#include "flight_diff.h"
#include "fuzz.h"
#include "loom/comm/flight_recorder.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto dir = loom::fuzz::scratch_dir() / "flight";
  static const bool made = [&] {
    loom::comm::FlightRecorder recorder(4);
    for (int i = 0; i < 3; ++i) {
      const uint64_t seq = recorder.enqueue("all_reduce", "float32", 16, {});
      recorder.start(seq);
      recorder.finish(seq, loom::comm::OpState::kCompleted);
    }
    recorder.enqueue("broadcast", "float32", 16, {0});
    recorder.dump(loom::comm::flight_dump_file(dir, 1), 1, "world");
    return true;
  }();
  (void)made;
  loom::fuzz::write_bytes(loom::comm::flight_dump_file(dir, 0), data, size);
  loom::fuzz::refuses_cleanly([&] { (void)loom::cli::diff_flight_dumps(dir); });
  return 0;
}
