#include "attnoracle/conformance/plugin_host.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <new>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/plugin.h"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::conformance {
namespace {

constexpr std::size_t kMessageBytes = 4096;  // the plugin's message buffer
constexpr std::int32_t kMaxDims = 16;
constexpr std::size_t kMaxNameBytes = 256;

struct Plugin {
  std::string name;
  attnoracle_plugin_run_fn run = nullptr;
};

std::string dl_error() {
  const char* e = ::dlerror();
  return e ? e : "unknown error";
}

// The library stays loaded until the process exits: unloading a runtime such as libtorch while
// its threads or static objects are alive is not worth the risk.
Plugin load_plugin(const std::string& lib) {
  ::dlerror();
  void* handle = ::dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) throw InputError(lib, "", "cannot load the plugin: " + dl_error());
  auto symbol = [&](const char* name) {
    void* p = ::dlsym(handle, name);
    if (!p)
      throw InputError(lib, name,
                       "not exported: not an AttnOracle plugin (see attnoracle/plugin.h)");
    return p;
  };
  // POSIX guarantees that a data pointer from dlsym converts to a function pointer.
  auto abi = reinterpret_cast<attnoracle_plugin_abi_fn>(symbol("attnoracle_plugin_abi"));
  auto name = reinterpret_cast<attnoracle_plugin_name_fn>(symbol("attnoracle_plugin_name"));
  Plugin p;
  p.run = reinterpret_cast<attnoracle_plugin_run_fn>(symbol("attnoracle_plugin_run"));
  const int version = abi();
  if (version != ATTNORACLE_PLUGIN_ABI)
    throw InputError(lib, "attnoracle_plugin_abi",
                     "the plugin speaks ABI version " + std::to_string(version) +
                         ", this host speaks version " + std::to_string(ATTNORACLE_PLUGIN_ABI));
  const char* n = name();
  p.name = n ? std::string(n, ::strnlen(n, kMaxNameBytes)) : "unnamed plugin";
  return p;
}

// The case in the plugin's view: pointers into `file`, which must outlive it.
struct CaseView {
  std::vector<std::string> dtypes;
  std::vector<attnoracle_tensor> tensors;
  std::vector<attnoracle_kv> metadata;
  attnoracle_case c{};
};

void make_view(const std::string& id, const SafeTensorsFile& file, CaseView& v) {
  std::vector<const RawTensor*> sorted;
  for (const auto& t : file.tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const RawTensor* a, const RawTensor* b) { return a->name < b->name; });
  for (const RawTensor* t : sorted) v.dtypes.emplace_back(dtype_name(t->dtype));
  for (std::size_t k = 0; k < sorted.size(); ++k) {
    const RawTensor& t = *sorted[k];
    v.tensors.push_back({t.name.c_str(), v.dtypes[k].c_str(),
                         static_cast<std::int32_t>(t.shape.size()),
                         t.shape.empty() ? nullptr : t.shape.data(),
                         t.data.empty() ? nullptr : t.data.data(), t.data.size()});
  }
  for (const auto& [key, value] : file.metadata) v.metadata.push_back({key.c_str(), value.c_str()});
  v.c = {id.c_str(), v.tensors.data(), v.tensors.size(), v.metadata.data(), v.metadata.size()};
}

// What the plugin emitted, and the first thing wrong with it.
struct Sink {
  SafeTensorsFile file;
  std::string problem;
};

std::string shape_text(std::int32_t ndim, const std::int64_t* shape) {
  std::string s = "[";
  for (std::int32_t a = 0; a < ndim; ++a) s += (a ? ", " : "") + std::to_string(shape[a]);
  return s + "]";
}

// Why a tensor from the plugin cannot be written, or "" when it can.
std::string check_tensor(const attnoracle_tensor* t, const SafeTensorsFile& taken) {
  if (!t) return "a NULL tensor";
  if (!t->name || !*t->name) return "a tensor without a name";
  const std::string name(t->name, ::strnlen(t->name, kMaxNameBytes + 1));
  if (name.size() > kMaxNameBytes) return "a tensor name longer than 256 bytes";
  for (unsigned char ch : name)
    if (ch < 0x20 || ch >= 0x7f) return "a tensor name with a byte outside printable ASCII";
  const std::string what = "tensor '" + name + "': ";
  if (name == "__metadata__") return what + "reserved name";
  if (taken.find(name)) return what + "emitted twice";
  if (!t->dtype) return what + "NULL dtype";
  const std::string dtype(t->dtype, ::strnlen(t->dtype, 16));
  const auto type = dtype_from_name(dtype);
  if (!type) return what + "unknown dtype '" + dtype + "'";
  if (t->ndim < 0 || t->ndim > kMaxDims)
    return what + "ndim " + std::to_string(t->ndim) + " (0 to 16)";
  if (t->ndim > 0 && !t->shape) return what + "NULL shape";
  std::uint64_t count = 1;
  bool too_big = false;
  for (std::int32_t a = 0; a < t->ndim; ++a) {
    if (t->shape[a] < 0) return what + "negative size in shape " + shape_text(t->ndim, t->shape);
    const auto n = static_cast<std::uint64_t>(t->shape[a]);
    if (n != 0 && count > kMaxOutputBytes / n) too_big = true;
    count *= n;
  }
  const std::uint64_t size = dtype_size(*type);
  if (too_big || count > kMaxOutputBytes / size)
    return what + "shape " + shape_text(t->ndim, t->shape) + " is larger than 1 GiB";
  if (t->nbytes != count * size)
    return what + std::to_string(t->nbytes) + " bytes, but " + dtype + " " +
           shape_text(t->ndim, t->shape) + " needs " + std::to_string(count * size);
  if (t->nbytes > 0 && !t->data) return what + "NULL data";
  return "";
}

// The sink's emit: copies a valid tensor, records the first problem. Never throws.
int emit_tensor(void* ctx, const attnoracle_tensor* t) {
  auto& sink = *static_cast<Sink*>(ctx);
  try {
    std::string problem = check_tensor(t, sink.file);
    if (problem.empty()) {
      RawTensor r;
      r.name = t->name;
      r.dtype = *dtype_from_name(t->dtype);
      r.shape.assign(t->shape, t->shape + t->ndim);
      const auto* bytes = static_cast<const unsigned char*>(t->data);
      r.data.assign(bytes, bytes + t->nbytes);
      sink.file.put(std::move(r));
      return 0;
    }
    if (sink.problem.empty()) sink.problem = std::move(problem);
  } catch (const std::bad_alloc&) {
    if (sink.problem.empty()) sink.problem = "out of memory while copying an emitted tensor";
  }
  return 1;
}

void write_text(const std::string& path, const std::string& text) {
  const std::string line = text + "\n";
  write_file_atomic(path, std::vector<unsigned char>(line.begin(), line.end()));
}

// One job: exactly one of output, output.error, output.unsupported.
void run_job(const Plugin& plugin, const std::string& id, const std::string& input,
             const std::string& output) {
  SafeTensorsFile file;
  try {
    file = read_safetensors(input);
  } catch (const InputError& e) {
    write_text(output + ".error", "plugin host: cannot read the case: " + e.message());
    return;
  } catch (const std::bad_alloc&) {
    write_text(output + ".error", "plugin host: out of memory reading the case " + input);
    return;
  }
  // As the reference reads a case: golden tensors and keys (an evaluated file) are dropped.
  std::erase_if(file.tensors, [](const RawTensor& t) { return is_golden_tensor_name(t.name); });
  file.metadata.erase("attn.reference");
  file.metadata.erase("attn.undecided");
  CaseView view;
  make_view(id, file, view);
  Sink sink;
  const attnoracle_sink c_sink{&sink, &emit_tensor};
  std::vector<char> message(kMessageBytes, '\0');
  int status = ATTNORACLE_FAILED;
  try {
    status = plugin.run(&view.c, &c_sink, message.data(), message.size());
  } catch (const std::exception& e) {  // the ABI forbids it; report it rather than die
    write_text(output + ".error", plugin.name + " threw an exception: " + e.what());
    return;
  } catch (...) {
    write_text(output + ".error", plugin.name + " threw an exception");
    return;
  }
  message.back() = '\0';
  const std::string text = message.data();
  if (!sink.problem.empty()) {
    write_text(output + ".error", plugin.name + " emitted a bad output: " + sink.problem);
    return;
  }
  switch (status) {
    case ATTNORACLE_OK: try { write_file_atomic(output, serialize_safetensors(sink.file));
      } catch (const InputError&) {
        throw;
      } catch (const std::exception& e) {
        write_text(output + ".error", plugin.name + ": its output cannot be written: " + e.what());
      }
      return;
    case ATTNORACLE_REFUSED:
      write_text(output + ".error", text.empty() ? plugin.name + " refused the case" : text);
      return;
    case ATTNORACLE_UNSUPPORTED:
      write_text(output + ".unsupported",
                 text.empty() ? plugin.name + ": unsupported (no message)" : text);
      return;
    case ATTNORACLE_FAILED:
      write_text(output + ".error",
                 plugin.name + " failed" + (text.empty() ? std::string() : ": " + text));
      return;
    default:
      write_text(output + ".error",
                 plugin.name + " returned the unknown status " + std::to_string(status));
  }
}

}  // namespace

int plugin_host_main(const std::string& lib, const std::string& jobs_path) {
  Plugin plugin;
  std::ifstream jobs;
  try {
    jobs.open(jobs_path);
    if (!jobs) throw InputError(jobs_path, "", "cannot read the jobs file");
    plugin = load_plugin(lib);
  } catch (const InputError& e) {
    std::fprintf(stderr, "attnoracle: error: %s\n", e.message().c_str());
    return 2;
  }
  std::string line;
  for (long number = 1; std::getline(jobs, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const auto job = nlohmann::json::parse(line);
      run_job(plugin, job.at("id").get<std::string>(), job.at("input").get<std::string>(),
              job.at("output").get<std::string>());
    } catch (const InputError& e) {  // an output that cannot be written: the runner sees it
      std::fprintf(stderr, "attnoracle: plugin-host: %s\n", e.message().c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "attnoracle: plugin-host: %s: line %ld: %s\n", jobs_path.c_str(), number,
                   e.what());
    }
  }
  return 0;
}

}  // namespace attnoracle::conformance
