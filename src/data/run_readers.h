// The readers a run opened, recorded in <run_dir>/readers.json, so that tools can show the
// samples a run reads from its run directory alone (`loom data show|serve RUN_DIR`).
// Runtime::open_dataset and open_mixture record each reader they open, on rank 0. Private to Loom
// and its tools.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "loom/data/mixture.h"
#include "loom/data/reader.h"

namespace loom::data {

// One recorded reader: the dataset as the program named it, the directory or URL it resolved
// to, its content version, and its options (rank 0; every rank's differ only in rank).
struct RunReader {
  std::string dataset;
  std::string dir;
  std::string version;
  ReaderOptions options;  // the fields a position depends on; the rest at their defaults
  // A mixture (Runtime::open_mixture): its sources, as named, resolved, versioned and weighted;
  // dataset, dir and version above are then its first source's. Empty for one dataset.
  struct Source {
    std::string dataset, dir, version;
    double weight = 1;
    bool stop = false;  // SourceEpochs::kStop
  };
  std::vector<Source> mixture;
};

// The file the readers are recorded in.
std::filesystem::path run_readers_file(const std::filesystem::path& run_dir);

// Adds `reader`, opened as `dataset`, to <run_dir>/readers.json (written atomically) unless an
// equal entry is there already. Not safe against two processes recording at once (only rank 0
// records). IoError when the file cannot be written.
void record_run_reader(const std::filesystem::path& run_dir, const std::string& dataset,
                       const Reader& reader);
// The same for a mixture.
void record_run_mixture(const std::filesystem::path& run_dir, const Mixture& mixture);

// The recorded readers, in the order they were first opened. IoError when the file is missing
// (naming the run directory and what writes it); CorruptData when it is malformed.
std::vector<RunReader> run_readers(const std::filesystem::path& run_dir);

}  // namespace loom::data
