// Uses the installed Loom through its public API only: a Runtime, its config and a store.
#include <loom/loom.h>

#include <iostream>

int main(int argc, char** argv) {
  loom::ConfigSchema keys;
  keys.add("consumer.greeting", "hello", "what to print");
  return loom::run_main(argc, argv, keys, [](loom::Runtime& rt) {
    loom::comm::InMemoryStore store;
    store.set("greeting", rt.config().get<std::string>("consumer.greeting"));
    std::cout << "consumer: " << store.get("greeting") << " from rank " << rt.rank() << " of "
              << rt.world_size() << ", loom " << loom::version() << std::endl;
  });
}
