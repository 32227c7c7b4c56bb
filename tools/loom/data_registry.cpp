// `loom data register|ls|info|tag|diff|migrate`: the dataset registry (loom/data/registry.h)
// and format migrations, from the command line.
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include "data_commands.h"
#include "loom/data/dataset.h"
#include "loom/data/registry.h"
#include "loom/data/remote.h"
#include "loom/error.h"
#include "progress.h"
#include "util/hash.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;

struct RegistryArgs {
  std::string registry;  // --registry; empty: $LOOM_DATA_REGISTRY
  std::string name;
  std::string dir;
  std::string ref;
  std::string other;
  std::string tag;
  std::string parent;
};

void add_registry_option(CLI::App& app, RegistryArgs& args) {
  app.add_option("--registry", args.registry,
                 "the registry directory (default: $LOOM_DATA_REGISTRY)");
}

const char* kind_name(data::DatasetKind kind) {
  return kind == data::DatasetKind::kTokens ? "tokens" : "records";
}

std::string tags_of(const data::DatasetVersion& v) {
  std::string out;
  for (const std::string& t : v.tags) out += (out.empty() ? "" : ",") + t;
  return out.empty() ? "" : " [" + out + "]";
}

int run_register(const RegistryArgs& args) {
  auto registry = data::open_registry(args.registry);
  const size_t before = [&] {
    try {
      return registry->versions(args.name).size();
    } catch (const InvalidArgument&) {
      return size_t{0};  // a new name
    }
  }();
  const data::DatasetVersion v = registry->add(args.name, args.dir, {.parent = args.parent});
  const bool added = v.number > before;
  std::cout << (added ? "registered " : "already registered as ") << v.ref() << ": "
            << v.dir.string() << " (content version " << v.content_version << ", "
            << kind_name(v.kind) << ", " << v.items << " items, " << v.bytes << " bytes"
            << (v.lineage.parent.empty() ? "" : ", parent " + v.lineage.parent) << ")\n";
  return kExitOk;
}

int run_ls(const RegistryArgs& args) {
  auto registry = data::open_registry(args.registry);
  if (args.name.empty()) {
    for (const std::string& name : registry->names()) {
      const auto versions = registry->versions(name);
      std::string tags;
      for (const auto& v : versions) {
        for (const std::string& t : v.tags) tags += " " + t + "=" + std::to_string(v.number);
      }
      std::cout << name << "  latest " << versions.back().ref() << "  (" << versions.size()
                << " version" << (versions.size() == 1 ? "" : "s") << ")"
                << (tags.empty() ? "" : "  tags:" + tags) << "\n";
    }
    return kExitOk;
  }
  for (const data::DatasetVersion& v : registry->versions(args.name)) {
    std::cout << v.ref() << "  " << v.content_version << "  " << kind_name(v.kind) << "  "
              << v.items << " items  " << v.registered_at << "  " << v.dir.string() << tags_of(v)
              << "\n";
  }
  return kExitOk;
}

void print_lineage(const data::Lineage& l) {
  std::cout << "lineage:\n  command: " << (l.command.empty() ? "(unknown)" : l.command) << "\n"
            << "  tokenizer: " << (l.tokenizer.empty() ? "(none)" : l.tokenizer) << "\n"
            << "  parent: " << (l.parent.empty() ? "(none)" : l.parent) << "\n";
  for (const data::SourceFile& s : l.sources) {
    std::cout << "  source: " << s.path << " (" << s.bytes << " bytes, xxHash64 "
              << util::hash_hex(s.xxhash64) << ")\n";
  }
}

int run_info(const RegistryArgs& args) {
  auto registry = data::open_registry(args.registry);
  const data::DatasetVersion v = registry->get(args.ref);
  std::cout << v.ref() << tags_of(v) << "\n"
            << "content version: " << v.content_version << "\n"
            << (data::is_remote(v.dir.string()) ? "url: " : "directory: ") << v.dir.string() << "\n"
            << "kind: " << kind_name(v.kind) << ", " << v.items << " items, " << v.bytes
            << " bytes\n"
            << "registered: " << v.registered_at << "\n";
  print_lineage(v.lineage);
  try {
    data::resolve_dataset(v.ref(), registry->location());
    std::cout << "files: the " << (data::is_remote(v.dir.string()) ? "URL" : "directory")
              << " holds the registered content\n";
    return kExitOk;
  } catch (const Error& e) {
    std::cout << "files: CHANGED: " << e.what() << "\n";
    return kExitFailed;
  }
}

int run_tag(const RegistryArgs& args) {
  auto registry = data::open_registry(args.registry);
  registry->tag(args.ref, args.tag);
  const data::DatasetVersion v = registry->get(args.ref);
  std::cout << v.name << "@" << args.tag << " -> " << v.ref() << "\n";
  return kExitOk;
}

// Lines "- x" / "+ y" for what differs between two keyed sets.
template <typename T, typename Describe>
bool diff_maps(const char* what, const std::map<std::string, T>& a,
               const std::map<std::string, T>& b, Describe describe) {
  bool any = false;
  for (const auto& [key, value] : a) {
    auto it = b.find(key);
    if (it == b.end()) {
      std::cout << "  - " << what << " " << key << " " << describe(value) << "\n";
      any = true;
    } else if (describe(it->second) != describe(value)) {
      std::cout << "  ~ " << what << " " << key << " " << describe(value) << " -> "
                << describe(it->second) << "\n";
      any = true;
    }
  }
  for (const auto& [key, value] : b) {
    if (!a.count(key)) {
      std::cout << "  + " << what << " " << key << " " << describe(value) << "\n";
      any = true;
    }
  }
  return any;
}

int run_diff(const RegistryArgs& args) {
  auto registry = data::open_registry(args.registry);
  const data::DatasetVersion a = registry->get(args.ref);
  const data::DatasetVersion b = registry->get(args.other);
  std::cout << "--- " << a.ref() << " (" << a.content_version << ", " << a.dir.string() << ")\n"
            << "+++ " << b.ref() << " (" << b.content_version << ", " << b.dir.string() << ")\n";
  if (a.content_version == b.content_version) {
    std::cout << "same content (content version " << a.content_version << ")\n";
  }
  auto line = [](const char* what, const std::string& x, const std::string& y) {
    if (x != y) std::cout << "  ~ " << what << ": " << x << " -> " << y << "\n";
  };
  line("kind", kind_name(a.kind), kind_name(b.kind));
  line("items", std::to_string(a.items), std::to_string(b.items));
  line("bytes", std::to_string(a.bytes), std::to_string(b.bytes));
  line("command", a.lineage.command, b.lineage.command);
  line("tokenizer", a.lineage.tokenizer, b.lineage.tokenizer);
  line("parent", a.lineage.parent, b.lineage.parent);
  std::map<std::string, data::SourceFile> sa, sb;
  for (const auto& s : a.lineage.sources) sa[s.path] = s;
  for (const auto& s : b.lineage.sources) sb[s.path] = s;
  diff_maps("source", sa, sb, [](const data::SourceFile& s) {
    return std::to_string(s.bytes) + " bytes " + util::hash_hex(s.xxhash64);
  });
  // The manifests, when both directories still hold what was registered.
  try {
    auto manifest_of = [&](const data::DatasetVersion& v) {
      return data::read_manifest(data::resolve_dataset(v.ref(), registry->location()).dir.string(),
                                 data::RemoteOptions{});
    };
    const data::Manifest ma = manifest_of(a);
    const data::Manifest mb = manifest_of(b);
    line("description", ma.description, mb.description);
    line("vocab_size", std::to_string(ma.vocab_size), std::to_string(mb.vocab_size));
    std::map<std::string, data::ShardInfo> ha, hb;
    for (const auto& s : ma.shards) ha[s.file] = s;
    for (const auto& s : mb.shards) hb[s.file] = s;
    diff_maps("shard", ha, hb, [](const data::ShardInfo& s) {
      return std::to_string(s.items) + " items " + util::hash_hex(s.xxhash64);
    });
    std::map<std::string, data::FileInfo> ta, tb;
    for (const auto& f : ma.tokenizer_files) ta[f.file] = f;
    for (const auto& f : mb.tokenizer_files) tb[f.file] = f;
    diff_maps("tokenizer file", ta, tb, [](const data::FileInfo& f) {
      return std::to_string(f.bytes) + " bytes " + util::hash_hex(f.xxhash64);
    });
  } catch (const Error& e) {
    std::cout << "(manifests not compared: " << e.what() << ")\n";
  }
  return kExitOk;
}

int run_migrate(const std::string& dir) {
  LOOM_CHECK(!data::is_remote(dir), InvalidArgument,
             "`loom data migrate` rewrites a local dataset ", "directory, and ", dir,
             " is a URL: download the dataset, migrate the copy, and upload it again");
  const data::Manifest m = data::read_manifest(dir);
  Progress progress("checking shards", m.total_bytes(), "bytes");
  const data::MigrateReport r =
      data::migrate_dataset(dir, [&](uint64_t done, uint64_t) { progress.update(done); });
  progress.finish(m.total_bytes());
  if (!r.rewritten) {
    std::cout << dir << " is already format " << r.to_format << "; nothing to do (version "
              << r.old_version << ")\n";
  } else if (r.new_version == r.old_version) {
    std::cout << "migrated " << dir << " from format " << r.from_format << " to " << r.to_format
              << "; content version " << r.new_version << " kept\n";
  } else {
    std::cout << "migrated " << dir << " from format " << r.from_format << " to " << r.to_format
              << "; content version " << r.old_version << " -> " << r.new_version
              << " (the tokenizer files are now part of it; states and registry entries of "
              << r.old_version << " still apply)\n";
  }
  return kExitOk;
}

}  // namespace

void register_data_registry(CLI::App& data, Action& action) {
  auto args = std::make_shared<RegistryArgs>();
  const char* footer =
      "Names: NAME@N (a version), NAME@latest or NAME (the newest), NAME@TAG. The registry is a\n"
      "directory: $LOOM_DATA_REGISTRY or --registry DIR. Guide: docs/datasets.md.";

  CLI::App* reg =
      data.add_subcommand("register", "Record a dataset directory as NAME's next version.");
  reg->add_option("name", args->name, "the dataset's name")->required();
  reg->add_option("dir", args->dir, "the dataset directory, or the URL of a remote dataset")
      ->required()
      ->check(CLI::Validator(
          [](std::string& dir) -> std::string {
            return data::is_remote(dir) ? "" : CLI::ExistingDirectory(dir);
          },
          "DIR|URL"));
  reg->add_option("--parent", args->parent,
                  "the version this one derives from (default: NAME@latest)");
  add_registry_option(*reg, *args);
  reg->footer(footer);
  reg->callback([args, &action] { action = [args] { return run_register(*args); }; });

  CLI::App* ls = data.add_subcommand("ls", "List registered datasets, or the versions of NAME.");
  ls->add_option("name", args->name, "a dataset name");
  add_registry_option(*ls, *args);
  ls->footer(footer);
  ls->callback([args, &action] { action = [args] { return run_ls(*args); }; });

  CLI::App* info = data.add_subcommand(
      "info", "Show a version: directory, lineage, tags, whether its files changed.");
  info->add_option("ref", args->ref, "NAME@N, NAME@latest or NAME@TAG")->required();
  add_registry_option(*info, *args);
  info->footer("Exit codes: 0 the files hold the registered content, 1 they changed, 2 bad input.");
  info->callback([args, &action] { action = [args] { return run_info(*args); }; });

  CLI::App* tag = data.add_subcommand("tag", "Point TAG of a dataset at a version.");
  tag->add_option("ref", args->ref, "NAME@N")->required();
  tag->add_option("tag", args->tag, "the tag (not a number, not 'latest')")->required();
  add_registry_option(*tag, *args);
  tag->footer(footer);
  tag->callback([args, &action] { action = [args] { return run_tag(*args); }; });

  CLI::App* diff = data.add_subcommand("diff", "What differs between two versions.");
  diff->add_option("a", args->ref, "NAME@A")->required();
  diff->add_option("b", args->other, "NAME@B")->required();
  add_registry_option(*diff, *args);
  diff->footer(footer);
  diff->callback([args, &action] { action = [args] { return run_diff(*args); }; });

  auto migrate_dir = std::make_shared<std::string>();
  CLI::App* migrate =
      data.add_subcommand("migrate", "Rewrite a dataset to the current format version.");
  migrate->add_option("dir", *migrate_dir, "the dataset directory")->required();
  migrate->footer(
      "Every shard is checked against its manifest first; only manifest.json is rewritten.\n"
      "The content version is kept unless the old format left content out (docs/datasets.md).");
  migrate->callback(
      [migrate_dir, &action] { action = [migrate_dir] { return run_migrate(*migrate_dir); }; });
}

}  // namespace loom::cli
