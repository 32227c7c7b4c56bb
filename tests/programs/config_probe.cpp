// A minimal Loom program for the command-line tests: declares two keys, prints them.
#include <loom/loom.h>

#include <iostream>

int main(int argc, char** argv) {
  loom::ConfigSchema keys;
  keys.add("train.steps", 10, "optimizer steps");
  keys.add("train.lr", 0.1, "learning rate");
  return loom::run_main(argc, argv, keys, [](loom::Runtime& rt) {
    std::cout << "steps=" << rt.config().get<int64_t>("train.steps")
              << " lr=" << rt.config().get<double>("train.lr") << std::endl;
  });
}
