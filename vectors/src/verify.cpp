// verify: a vector set against its manifest, its hashes, the case format, the invariants of
// stored golden data, and (on request) a bitwise re-evaluation.
#include "attnoracle/vectors/verify.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <set>

#include "attnoracle/vectors/model_store.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/manifest.hpp"
#include "attnoracle/reference/parallel.hpp"
#include "attnoracle/reference/verified_stamp.hpp"
#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/vectors/problem.hpp"
#include "numbers.hpp"

namespace attnoracle::vectors {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

// The stored golden tensors against a fresh evaluation: the same set, bit for bit.
std::optional<std::string> compare_recomputed(const SafeTensorsFile& stored,
                                              const SafeTensorsFile& fresh) {
  for (const RawTensor& t : fresh.tensors) {
    if (!is_golden_tensor_name(t.name)) continue;
    const RawTensor* s = stored.find(t.name);
    if (!s) return t.name + ": missing, the re-evaluation gives one";
    if (s->dtype != t.dtype || s->shape != t.shape)
      return t.name + ": dtype or shape differs from the re-evaluation";
    if (s->data == t.data) continue;
    const std::size_t size = dtype_size(t.dtype);
    for (std::size_t e = 0; e * size < t.data.size(); ++e)
      if (std::memcmp(s->data.data() + e * size, t.data.data() + e * size, size) != 0) {
        std::string detail;
        if (is_float_format(t.dtype))
          detail = " (stored " + hexf(decode_float(t.dtype, s->data.data() + e * size)) +
                   ", recomputed " + hexf(decode_float(t.dtype, t.data.data() + e * size)) + ")";
        return t.name + ": element " + std::to_string(e) + " differs from the re-evaluation" +
               detail;
      }
  }
  for (const RawTensor& s : stored.tensors)
    if (is_golden_tensor_name(s.name) && !fresh.find(s.name))
      return s.name + ": present, the re-evaluation gives none";
  if (stored.metadata.count("attn.undecided") &&
      stored.metadata.at("attn.undecided") != fresh.metadata.at("attn.undecided"))
    return "attn.undecided: differs from the re-evaluation";
  return std::nullopt;
}

std::optional<std::string> check_case(const fs::path& dir, const ManifestCase& mc,
                                      const VerifyOptions& opt) {
  const fs::path path = dir / mc.file;
  if (!fs::exists(fs::symlink_status(path))) return "missing file " + mc.file;
  Bytes bytes;
  try {
    bytes = read_file_within(dir.string(), mc.file);
  } catch (const InputError& e) {
    return mc.file + ": " + e.what();
  }
  const std::string sha = sha256_hex(bytes);
  if (sha != mc.sha256) return "sha256 " + sha + " differs from the manifest's " + mc.sha256;
  SafeTensorsFile f;
  Case c;
  try {
    f = parse_safetensors(path.string(), bytes);
    c = case_from_file(path.string(), f);
  } catch (const InputError& e) {
    return "invalid case file: " + e.message();
  }
  const bool refused = c.first_refused_row().has_value();
  if (mc.expect == "error") {
    if (!refused) return "expect is error, but every row that is not padding has a key to attend";
    for (const RawTensor& t : f.tensors)
      if (is_golden_tensor_name(t.name))
        return t.name + ": golden tensor in a case expected to fail";
  } else {
    if (refused) return "expect is ok, but a row is fully masked under attn.masked_rows=error";
    if (auto p = golden_layout_problem(c, f)) return p;
    if (auto p = golden_invariant_problem(c, f)) return p;
  }
  if (!opt.recompute) return std::nullopt;
  EvalOptions eval;
  eval.threads = 1;
  eval.max_precision = opt.max_precision;
  try {
    const EvalResult r = oracle::certified_evaluate(c, eval, oracle::CheckOptions{});
    if (mc.expect == "error") return "re-evaluation does not refuse the case";
    SafeTensorsFile fresh = golden_file(c, r);
    if (f.find("model.rows") && model_store().put) model_store().put(c, fresh);  // a stored model: recomputed too
    return compare_recomputed(f, fresh);
  } catch (const FullyMaskedRow& e) {
    if (mc.expect == "error") return std::nullopt;
    return std::string("re-evaluation refuses the case: ") + e.what();
  } catch (const oracle::InvariantViolation& e) {
    return "re-evaluation violates an invariant: " + e.violations().front().message();
  } catch (const InputError& e) {
    return "re-evaluation refuses the case: " + e.message();
  }
}

}  // namespace

VerifyReport verify(const VerifyOptions& opt,
                    const std::function<void(std::size_t, std::size_t)>& progress) {
  const fs::path dir(opt.dir);
  const bool other = !opt.manifest.empty();
  const std::string mpath = other ? opt.manifest : (dir / "manifest.json").string();
  const Bytes bytes = other ? read_regular_file(opt.manifest, limits::kManifestBytes)
                            : read_file_within(opt.dir, "manifest.json", limits::kManifestBytes);
  const std::string text(bytes.begin(), bytes.end());
  std::string problem;
  const Manifest m = parse_manifest(mpath, text, problem);

  VerifyReport rep;
  rep.cases = m.cases.size();
  if (!problem.empty()) {
    rep.problems.push_back({other ? opt.manifest : "manifest.json", problem});
    return rep;
  }
  // The set's own manifest, where it has one, is the other one byte for byte.
  if (other && fs::exists(fs::symlink_status(dir / "manifest.json")) &&
      read_file_within(opt.dir, "manifest.json", limits::kManifestBytes) != bytes) {
    rep.problems.push_back({"manifest.json", "differs from " + opt.manifest});
    if (!opt.all) return rep;
  }

  // cases/ a link that leaves the set: refused before anything in it is listed or read.
  if (fs::exists(fs::symlink_status(dir / "cases"))) path_within(opt.dir, "cases");

  // Files in cases/ that the manifest does not list (temporary files of a stopped run too).
  std::set<std::string> listed;
  for (const auto& c : m.cases) listed.insert(fs::path(c.file).filename().string());
  std::error_code ec;
  if (fs::is_directory(dir / "cases")) {
    std::vector<std::string> extra;
    for (const auto& e : fs::directory_iterator(dir / "cases", ec))
      if (!listed.count(e.path().filename().string()))
        extra.push_back("cases/" + e.path().filename().string());
    std::sort(extra.begin(), extra.end());
    for (const auto& x : extra) {
      rep.problems.push_back({x, "not listed in the manifest"});
      if (!opt.all) return rep;
    }
  }

  std::vector<std::optional<std::string>> found(m.cases.size());
  std::vector<char> checked(m.cases.size(), 0);
  std::mutex mu;
  std::size_t done = 0;
  struct Stop {};  // a problem found without --all: no later case is started
  try {
    parallel_for(m.cases.size(), opt.jobs, [&](std::size_t k) {
      auto p = check_case(dir, m.cases[k], opt);
      std::lock_guard<std::mutex> lk(mu);
      found[k] = std::move(p);
      checked[k] = 1;
      if (progress) progress(++done, m.cases.size());
      if (found[k] && !opt.all) throw Stop{};
    });
  } catch (const Stop&) {
  }

  std::vector<std::pair<std::string, std::string>> verified;  // for the set's stamp
  for (std::size_t k = 0; k < m.cases.size(); ++k) {
    if (!checked[k]) continue;
    if (!found[k]) {
      ++rep.checked;
      verified.emplace_back(m.cases[k].file, m.cases[k].sha256);
      continue;
    }
    rep.problems.push_back({m.cases[k].id, *found[k]});
    if (!opt.all) break;
  }
  record_verified(opt.dir, verified);
  return rep;
}

}  // namespace attnoracle::vectors
