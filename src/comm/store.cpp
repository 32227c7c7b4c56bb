// InMemoryStore (threads as ranks) and PrefixStore (key namespacing over any store).

#include "loom/comm/store.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "comm/counter.h"
#include "loom/error.h"

namespace loom::comm {
namespace {

using Clock = std::chrono::steady_clock;

Timeout missing_keys_error(std::chrono::milliseconds timeout, const std::vector<std::string>& keys,
                           const std::map<std::string, std::string>& data) {
  std::string missing;
  for (const std::string& key : keys) {
    if (data.count(key) == 0) missing += (missing.empty() ? "'" : ", '") + key + "'";
  }
  return Timeout(detail::concat("InMemoryStore: timed out after ", timeout.count(),
                                " ms waiting for key(s) ", missing));
}

}  // namespace

void InMemoryStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    data_[key] = value;
  }
  changed_.notify_all();
}

std::string InMemoryStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool present =
      changed_.wait_until(lock, Clock::now() + timeout, [&] { return data_.count(key) != 0; });
  if (!present) throw missing_keys_error(timeout, {key}, data_);
  return data_.at(key);
}

int64_t InMemoryStore::add(const std::string& key, int64_t delta) {
  int64_t result = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = data_.find(key);
    const int64_t current = it == data_.end() ? 0 : parse_counter("InMemoryStore", key, it->second);
    LOOM_CHECK(!__builtin_add_overflow(current, delta, &result), InvalidArgument,
               "InMemoryStore::add: key '", key, "' would overflow (", current, " + ", delta, ")");
    data_[key] = std::to_string(result);
  }
  changed_.notify_all();
  return result;
}

std::string InMemoryStore::compare_set(const std::string& key, const std::string& expected,
                                       const std::string& desired) {
  std::string result;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = data_.find(key);
    const bool matches = it == data_.end() ? expected.empty() : it->second == expected;
    if (!matches) return it == data_.end() ? std::string() : it->second;
    data_[key] = desired;
    result = desired;
  }
  changed_.notify_all();
  return result;
}

void InMemoryStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto all_present = [&] {
    return std::all_of(keys.begin(), keys.end(),
                       [&](const std::string& key) { return data_.count(key) != 0; });
  };
  std::unique_lock<std::mutex> lock(mutex_);
  if (!changed_.wait_until(lock, Clock::now() + timeout, all_present)) {
    throw missing_keys_error(timeout, keys, data_);
  }
}

bool InMemoryStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::all_of(keys.begin(), keys.end(),
                     [&](const std::string& key) { return data_.count(key) != 0; });
}

bool InMemoryStore::remove(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.erase(key) != 0;
}

PrefixStore::PrefixStore(std::string prefix, Store& base)
    : prefix_(std::move(prefix)), base_(base) {}

void PrefixStore::set(const std::string& key, const std::string& value) {
  base_.set(full(key), value);
}

std::string PrefixStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return base_.get(full(key), timeout);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return base_.add(full(key), delta);
}

std::string PrefixStore::compare_set(const std::string& key, const std::string& expected,
                                     const std::string& desired) {
  return base_.compare_set(full(key), expected, desired);
}

void PrefixStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  base_.wait(full(keys), timeout);
}

bool PrefixStore::check(const std::vector<std::string>& keys) { return base_.check(full(keys)); }

bool PrefixStore::remove(const std::string& key) { return base_.remove(full(key)); }

std::vector<std::string> PrefixStore::full(const std::vector<std::string>& keys) const {
  std::vector<std::string> result;
  result.reserve(keys.size());
  for (const std::string& key : keys) result.push_back(full(key));
  return result;
}

int64_t parse_counter(const char* store, const std::string& key, const std::string& value) {
  const bool starts_well =
      !value.empty() && (value[0] == '-' || std::isdigit(static_cast<unsigned char>(value[0])));
  char* end = nullptr;
  errno = 0;
  const long long parsed = starts_well ? std::strtoll(value.c_str(), &end, 10) : 0;
  LOOM_CHECK(starts_well && errno == 0 && end == value.c_str() + value.size(), InvalidArgument,
             store, "::add: key '", key, "' holds '", value, "', which is not a decimal integer");
  return parsed;
}

}  // namespace loom::comm
