// gen: expands a suite, builds and evaluates each case in parallel, writes case files and the
// manifest. Every file is written under a temporary name and renamed, so a file present is
// complete; a rerun keeps the present files that still match the spec.
#include "attnoracle/vectors/generate.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "attnoracle/vectors/model_store.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/verified_stamp.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/limits.hpp"
#include "attnoracle/version.hpp"
#include "attnoracle/reference/manifest.hpp"
#include "attnoracle/reference/parallel.hpp"
#include "attnoracle/vectors/problem.hpp"
#include "attnoracle/vectors/verify.hpp"


namespace attnoracle::vectors {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

// The bytes of a file left by an earlier run, when there is one that can be read.
std::optional<Bytes> earlier_file(const fs::path& p) {
  try {
    return read_regular_file(p.string());
  } catch (const InputError&) {
    return std::nullopt;
  }
}

bool same_tensor(const RawTensor& a, const RawTensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.data == b.data;
}

// An existing case file is kept when its inputs and metadata are those the spec gives now, it
// was made by this version of the reference, and its golden tensors are all there.
bool present_matches(const std::string& path, const Bytes& bytes, const SafeTensorsFile& inputs,
                     const Case& c, bool refused, bool model) {
  if (refused) return bytes == serialize_safetensors(inputs);
  SafeTensorsFile f;
  try {
    f = parse_safetensors(path, bytes);
  } catch (const InputError&) {
    return false;
  }
  auto md = f.metadata;
  const auto ref = md.find("attn.reference");
  if (ref == md.end() || ref->second != generator_name()) return false;
  md.erase("attn.reference");
  md.erase("attn.undecided");
  if (md != inputs.metadata) return false;
  if ((f.find("model.rows") != nullptr) != (model && c.kind == Kind::Sdpa)) return false;
  std::size_t n_inputs = 0;
  for (const RawTensor& t : f.tensors) {
    if (is_golden_tensor_name(t.name)) continue;
    const RawTensor* want = inputs.find(t.name);
    if (!want || !same_tensor(t, *want)) return false;
    ++n_inputs;
  }
  return n_inputs == inputs.tensors.size() && !golden_layout_problem(c, f);
}

struct Outcome {
  bool done = false;
  std::string sha256;
  bool refused = false;
  bool fully_masked = false;
};

}  // namespace

std::string generator_name() { return std::string(kNameAndVersion); }

namespace {

// A lock on the set's directory for the length of a run (flock on the directory itself, so no
// file is added to the set): shards share it, an unsharded run (which removes the temporary
// files of stopped runs and writes the manifest) holds it alone. A run that cannot have it
// is refused at once rather than waiting.
class DirectoryLock {
 public:
  DirectoryLock(const std::string& dir, bool exclusive)
      : fd_(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) {
    if (fd_ < 0) throw InputError(dir, "", std::string("cannot open: ") + std::strerror(errno));
    if (::flock(fd_, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd_);
      throw InputError(dir, "", err != EWOULDBLOCK ? std::string("cannot lock: ") + std::strerror(err)
                                : exclusive ? "another attnoracle gen is writing into it"
                                            : "an unsharded attnoracle gen is writing into it");
    }
  }
  ~DirectoryLock() { ::close(fd_); }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_;
};

}  // namespace

GenSummary generate(const GenOptions& opt, const GenCallbacks& cb) {
  if (opt.model && !model_store().put)
    throw std::logic_error("gen --model: no model store installed (vectors::install_model_store)");
  const auto spec_bytes = std::optional<Bytes>(read_regular_file(opt.spec_path, limits::kManifestBytes));
  const std::string spec_text(spec_bytes->begin(), spec_bytes->end());
  const Suite suite = parse_suite(opt.spec_path, spec_text);

  for (const std::string& id : opt.ids)
    if (std::none_of(suite.cases.begin(), suite.cases.end(), [&](const CaseSpec& c) { return c.id == id; }))
      throw InputError("--case", "", "no case \"" + printable(id) + "\" in " + opt.spec_path);
  // A run over some of the cases writes no manifest, as a shard.
  const bool partial = opt.sharded || !opt.ids.empty();
  const fs::path dir(opt.out_dir), cases_dir = dir / "cases";
  std::error_code ec;
  fs::create_directories(cases_dir, ec);
  if (ec || !fs::is_directory(cases_dir))
    throw InputError(opt.out_dir, "", "cannot create " + cases_dir.string() + ": " + ec.message());
  const DirectoryLock lock(opt.out_dir, !partial);
  // A manifest present means a complete set: it goes until this run has made one again.
  fs::remove(dir / "manifest.json", ec);
  if (!partial) {
    // Temporary files of a stopped run ("<file>.tmp.<pid>"); a sharded run may share the
    // directory with other shards, so only the final run removes them.
    for (const auto& e : fs::directory_iterator(cases_dir, ec))
      if (e.path().filename().string().find(".safetensors.tmp.") != std::string::npos)
        fs::remove(e.path(), ec);
  }

  std::vector<std::size_t> selected;
  for (std::size_t k = 0; k < suite.cases.size(); ++k)
    if ((!opt.sharded ||
         k % static_cast<std::size_t>(opt.shard_n) == static_cast<std::size_t>(opt.shard_k)) &&
        (opt.ids.empty() || std::find(opt.ids.begin(), opt.ids.end(), suite.cases[k].id) != opt.ids.end()))
      selected.push_back(k);

  GenSummary sum;
  sum.suite_cases = suite.cases.size();
  sum.selected = selected.size();
  std::vector<Outcome> outcome(suite.cases.size());
  std::mutex mu;  // progress, counters
  std::size_t done = 0;

  EvalOptions eval;
  eval.threads = opt.threads_per_case;
  eval.max_precision = opt.max_precision;
  const oracle::CheckOptions check;

  auto report = [&](CaseEvent::What what, const CaseSpec& cs, double seconds) {
    std::lock_guard<std::mutex> lk(mu);
    ++done;
    if (what == CaseEvent::Written) ++sum.written;
    if (what == CaseEvent::Present) ++sum.present;
    if (what == CaseEvent::Failed) ++sum.failed;
    if (cb.progress) cb.progress({what, done, selected.size(), &cs, seconds});
  };

  auto one = [&](std::size_t k) {
    const CaseSpec& cs = suite.cases[k];
    const auto t0 = std::chrono::steady_clock::now();
    auto seconds = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    SafeTensorsFile inputs;
    try {
      inputs = make_problem(cs.problem, cs.seed);
    } catch (const std::invalid_argument& e) {
      throw InputError(opt.spec_path, "case " + cs.id, e.what());
    }
    const Case c = case_from_file(cs.id, inputs);
    Outcome& out = outcome[k];
    out.refused = c.first_refused_row().has_value();
    out.fully_masked = has_fully_masked_row(c);
    const fs::path path = cases_dir / (cs.id + ".safetensors");
    if (const auto old = earlier_file(path);
        old && present_matches(path, *old, inputs, c, out.refused, opt.model)) {
      out.sha256 = sha256_hex(*old);
      out.done = true;
      report(CaseEvent::Present, cs, seconds());
      return;
    }
    Bytes bytes;
    if (out.refused) {
      bytes = serialize_safetensors(inputs);
    } else {
      try {
        SafeTensorsFile golden = golden_file(c, oracle::certified_evaluate(c, eval, check));
        if (opt.model) model_store().put(c, golden);
        bytes = serialize_safetensors(golden);
      } catch (const oracle::InvariantViolation& e) {
        {
          std::lock_guard<std::mutex> lk(mu);
          if (cb.violation) cb.violation(cs.id, e);
        }
        report(CaseEvent::Failed, cs, seconds());
        return;
      } catch (const FullyMaskedRow& e) {
        throw InputError(opt.spec_path, "case " + cs.id,
                         std::string("refused unexpectedly: ") + e.what());
      } catch (const InputError& e) {
        throw InputError(opt.spec_path, "case " + cs.id, e.message());
      }
    }
    write_file_atomic(path.string(), bytes);
    out.sha256 = sha256_hex(bytes);
    out.done = true;
    report(CaseEvent::Written, cs, seconds());
  };

  // The first failing case is the one reported, whatever the scheduling.
  parallel_for(selected.size(), opt.jobs, [&](std::size_t s) { one(selected[s]); });

  for (std::size_t k = 0; k < suite.cases.size(); ++k)
    if (!outcome[k].done && !fs::exists(cases_dir / (suite.cases[k].id + ".safetensors")))
      ++sum.missing;
  if (partial || sum.failed > 0) return sum;

  Manifest m;
  m.suite = suite.name;
  m.generator = generator_name();
  m.seed = suite.seed;
  m.spec_sha256 = sha256_hex(*spec_bytes);
  for (std::size_t k = 0; k < suite.cases.size(); ++k) {
    const CaseSpec& cs = suite.cases[k];
    ManifestCase mc{cs.id, case_file_name(cs.id), outcome[k].sha256,
                    outcome[k].refused ? "error" : "ok", cs.tags};
    if (outcome[k].fully_masked &&
        std::find(mc.tags.begin(), mc.tags.end(), "fully_masked") == mc.tags.end())
      mc.tags.push_back("fully_masked");
    m.cases.push_back(std::move(mc));
  }
  const std::string text = manifest_text(m);
  write_file_atomic((dir / "manifest.json").string(), Bytes(text.begin(), text.end()));
  sum.manifest_written = true;
  // the files just written or found present, hashed here: `check` need not hash them again
  std::vector<std::pair<std::string, std::string>> verified;
  for (const ManifestCase& mc : m.cases) verified.emplace_back(mc.file, mc.sha256);
  record_verified(dir.string(), verified);
  return sum;
}

}  // namespace attnoracle::vectors
