// _attnoracle: the C++ libraries as the attnoracle package sees them. Tensors cross as tuples
// (name, dtype name, shape, bytes); the package (attnoracle/__init__.py) turns them into arrays.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/gate.hpp"
#include "attnoracle/conformance/keep_mask.hpp"
#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/limits.hpp"
#include "attnoracle/reference/manifest.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/reference/safetensors.hpp"
#include "attnoracle/version.hpp"

namespace py = pybind11;
namespace fs = std::filesystem;
using namespace attnoracle;

namespace {

using PyTensor = std::tuple<std::string, std::string, std::vector<std::int64_t>, py::bytes>;
using Metadata = std::map<std::string, std::string>;

PyObject* input_error_type = nullptr;
PyObject* invariant_error_type = nullptr;

DType dtype_of(const std::string& name, const std::string& file, const std::string& field) {
  const auto t = dtype_from_name(name);
  if (!t) throw InputError(file, field, "unknown dtype '" + printable(name) + "'");
  return *t;
}

SafeTensorsFile file_of(const std::vector<PyTensor>& tensors, const Metadata& metadata, const std::string& path) {
  SafeTensorsFile f;
  f.metadata = metadata;
  for (const auto& [name, dtype, shape, data] : tensors) {
    RawTensor t;
    t.name = name;
    t.dtype = dtype_of(dtype, path, name);
    t.shape = shape;
    const std::string_view bytes = data;
    t.data.assign(bytes.begin(), bytes.end());
    if (static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype) != t.data.size())
      throw InputError(path, name, "shape " + shape_string(shape) + " does not match " + std::to_string(t.data.size()) + " bytes");
    f.put(std::move(t));
  }
  return f;
}

PyTensor tensor_of(const RawTensor& t) {
  return {t.name, std::string(dtype_name(t.dtype)), t.shape,
          py::bytes(reinterpret_cast<const char*>(t.data.data()), t.data.size())};
}

std::vector<PyTensor> tensors_of(const SafeTensorsFile& f) {
  std::vector<PyTensor> out;
  for (const auto& t : f.tensors) out.push_back(tensor_of(t));
  return out;
}

// Doubles (a float64 buffer) into `dtype`: exactly, or rounded to nearest-even when `round`
// (F8_E4M3, which has no infinity, saturates to +-448 as round_double does).
py::bytes py_encode(const std::string& dtype, const py::bytes& values, bool round, const std::string& file,
                 const std::string& field) {
  const DType t = dtype_of(dtype, file, field);
  if (!is_input_format(t))
    throw InputError(file, field, "dtype " + dtype + " is not F64, F32, F16, BF16, F8_E4M3 or F8_E5M2");
  const std::string_view in = values;
  const std::size_t n = in.size() / sizeof(double);
  std::string out(n * dtype_size(t), '\0');
  for (std::size_t k = 0; k < n; ++k) {
    double x;
    std::memcpy(&x, in.data() + k * sizeof(double), sizeof x);
    const double r = round_double(x, t);
    if (!round && !(r == x || (std::isnan(r) && std::isnan(x)))) {
      char buf[120];
      std::snprintf(buf, sizeof buf, "element %zu (flat index), %.17g, is not representable in %s", k, x, dtype.c_str());
      throw InputError(file, field, buf);
    }
    encode_float(t, r, reinterpret_cast<unsigned char*>(out.data()) + k * dtype_size(t));
  }
  return py::bytes(out);
}

// The elements of a float tensor as doubles (a float64 buffer), decoded exactly by the format
// library: every input format embeds in F64.
py::bytes py_decode(const std::string& dtype, const py::bytes& data) {
  const DType t = dtype_of(dtype, "<decode>", "dtype");
  if (!is_input_format(t)) throw InputError("<decode>", "dtype", "dtype " + dtype + " is not a float format");
  const std::string_view in = data;
  const std::size_t size = dtype_size(t), n = in.size() / size;
  std::string out(n * sizeof(double), '\0');
  for (std::size_t k = 0; k < n; ++k) {
    const double x = decode_float(t, reinterpret_cast<const unsigned char*>(in.data()) + k * size);
    std::memcpy(out.data() + k * sizeof(double), &x, sizeof x);
  }
  return py::bytes(out);
}

// Certified evaluation, as `attnoracle eval` does it: the golden file's tensors and metadata,
// and the statistics.
py::tuple py_evaluate(const std::vector<PyTensor>& tensors, const Metadata& metadata, const std::string& path, int threads,
                   long max_precision) {
  SafeTensorsFile f = file_of(tensors, metadata, path);
  const Case c = case_from_file(path, std::move(f));
  EvalOptions opt;
  opt.threads = threads;
  opt.max_precision = max_precision;
  oracle::CheckOptions check;
  EvalResult r;
  {
    py::gil_scoped_release release;
    try {
      r = oracle::certified_evaluate(c, opt, check);
    } catch (const FullyMaskedRow& e) {
      throw InputError(path, "mask", e.what());
    }
  }
  const SafeTensorsFile g = golden_file(c, r);
  py::dict stats;
  stats["elements"] = r.stats.elements;
  stats["undecided"] = r.stats.undecided;
  stats["rows"] = r.stats.rows;
  stats["rows_fast"] = r.stats.rows_fast;
  stats["grad_units_fast"] = r.stats.grad_units_fast;
  stats["grad_units_fallback"] = r.stats.grad_units_fallback;
  stats["rows_raised"] = r.stats.rows_raised;
  stats["max_precision_reached"] = static_cast<long>(r.stats.max_precision_reached);
  stats["seconds"] = r.stats.seconds;
  return py::make_tuple(tensors_of(g), g.metadata, stats);
}

// A file read and checked as a case; the tensors (golden ones included) and metadata.
py::tuple py_read_case(const std::string& path) {
  SafeTensorsFile f = read_safetensors(path);
  case_from_file(path, f);
  return py::make_tuple(tensors_of(f), f.metadata);
}

void py_write_case(const std::string& path, const std::vector<PyTensor>& tensors, const Metadata& metadata) {
  SafeTensorsFile f = file_of(tensors, metadata, path);
  case_from_file(path, f);
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty() && !fs::is_directory(parent))
    throw InputError(path, "", "directory " + parent.string() + " does not exist");
  write_file_atomic(path, serialize_safetensors(f));
}

// Any safetensors file (a result, a file that is not a case), written atomically.
void py_write_file(const std::string& path, const std::vector<PyTensor>& tensors, const Metadata& metadata) {
  write_file_atomic(path, serialize_safetensors(file_of(tensors, metadata, path)));
}

// The manifest of a vector set: (suite, [(id, file, sha256, expect, tags)]), as the gate reads it.
py::tuple py_read_manifest(const std::string& dir) {
  if (!fs::is_directory(dir)) throw InputError(dir, "", "not a vector set directory");
  const std::string mpath = (fs::path(dir) / "manifest.json").string();
  const std::vector<unsigned char> text = read_file_within(dir, "manifest.json", limits::kManifestBytes);
  std::string problem;
  const vectors::Manifest m =
      vectors::parse_manifest(mpath, std::string_view(reinterpret_cast<const char*>(text.data()), text.size()), problem);
  if (!problem.empty()) throw InputError(mpath, "", problem);
  py::list cases;
  for (const auto& c : m.cases) cases.append(py::make_tuple(c.id, c.file, c.sha256, c.expect, c.tags));
  return py::make_tuple(m.suite, cases);
}

// A case file of a vector set, checked against the manifest's hash as the gate checks it.
py::tuple py_read_set_case(const std::string& dir, const std::string& file, const std::string& sha256) {
  const std::string path = (fs::path(dir) / file).string();
  SafeTensorsFile f = vectors::read_set_case(dir, file, sha256);
  case_from_file(path, f);
  return py::make_tuple(tensors_of(f), f.metadata);
}

conformance::Outcome outcome_of(const std::string& name) {
  using conformance::Outcome;
  for (Outcome o : {Outcome::Output, Outcome::Refused, Outcome::Unsupported, Outcome::Missing, Outcome::Crashed,
                    Outcome::TimedOut, Outcome::Invalid})
    if (conformance::outcome_name(o) == name) return o;
  throw InputError("<check>", "outcome", "unknown outcome '" + printable(name) + "'");
}

// The profile set `profile` (as --profile names one), or the one profile of the JSON object
// `profile_json` when it is not empty, with the declarations of `check --masked-rows, --returns`.
conformance::ProfileSet profile_set_of(const std::string& profile, const std::string& profile_json,
                                       const std::string& masked_rows, const std::string& returns) {
  if (profile_json.empty()) return conformance::declared_profile_set(profile, masked_rows, returns, "profile", "masked_rows");
  conformance::ProfileSet set;
  set.members.push_back(conformance::profile_from_json_text(profile_json, "profile"));
  set.name = set.members.front().name;
  conformance::Profile& p = set.members.front();
  if (!masked_rows.empty()) {
    const auto rows = conformance::convention_from_name(masked_rows);
    if (!rows) throw InputError("masked_rows", "", "must be error, zero, nan or mean");
    p.masked_rows = *rows;
  }
  if (!returns.empty()) conformance::declare_returns(p, returns);
  return set;
}

// The metadata of the case an implementation judged by `profile` (its member for the case's input
// dtype) is given, as the gate writes it: with the output dtypes the profile declares.
Metadata py_declared_metadata(const std::vector<PyTensor>& golden_tensors, const Metadata& golden_metadata,
                              const std::string& profile) {
  const SafeTensorsFile golden = file_of(golden_tensors, golden_metadata, "<case>");
  const conformance::ProfileSet set = conformance::load_profile_set(profile, "profile");
  const RawTensor* q = golden.find("q");
  if (!q) q = golden.find("x_q");
  const conformance::Profile* p = q ? set.for_dtype(q->dtype) : nullptr;
  return p ? conformance::case_for(golden, *p).metadata : golden_metadata;
}

// The gate's verdict on one case: compare_case under the member of the profile set for the
// case's input dtype, as `attnoracle check` computes it. Returns (JSON report of that one case,
// the text report's lines for it).
py::tuple py_check(const std::string& id, const std::vector<std::string>& tags, const std::vector<PyTensor>& golden_tensors,
                const Metadata& golden_metadata, const std::string& expect, const std::string& outcome,
                const std::string& reason, const std::vector<PyTensor>& result_tensors, const std::string& profile,
                const std::string& masked_rows, const std::string& returns, const std::string& profile_json) {
  const SafeTensorsFile golden = file_of(golden_tensors, golden_metadata, id);
  conformance::JobResult result;
  result.outcome = outcome_of(outcome);
  result.reason = reason;
  if (result.outcome == conformance::Outcome::Output) result.output = file_of(result_tensors, {}, id + " (result)");
  const conformance::ProfileSet set = profile_set_of(profile, profile_json, masked_rows, returns);
  conformance::GateReport rep;
  rep.implementation = "python";
  rep.profile = set.name;
  conformance::CaseReport r;
  {
    py::gil_scoped_release release;
    const RawTensor* q = golden.find("q");
    if (!q) q = golden.find("x_q");
    const conformance::Profile* p = q ? set.for_dtype(q->dtype) : &set.members.front();
    if (!p) {
      r.id = id;
      r.dtype = q->dtype;
      r.status = conformance::CaseStatus::Skip;
      r.reason = "profile " + set.name + " does not cover " + std::string(dtype_name(r.dtype)) + " inputs";
    } else {
      r = conformance::compare_case(id, golden, expect, result, *p);
      r.profile = p->name;
    }
  }
  r.tags = tags;
  switch (r.status) {
    case conformance::CaseStatus::Pass: ++rep.passed; break;
    case conformance::CaseStatus::Fail: ++rep.failed; break;
    case conformance::CaseStatus::Skip: ++rep.skipped; break;
  }
  rep.cases.push_back(std::move(r));
  return py::make_tuple(conformance::json_report(rep), conformance::text_report(rep, true));
}

void raise(PyObject* type, const std::string& message, py::object file, py::object field) {
  py::object e = py::reinterpret_borrow<py::object>(type)(message);
  e.attr("file") = std::move(file);
  e.attr("field") = std::move(field);
  PyErr_SetObject(type, e.ptr());
}

}  // namespace

PYBIND11_MODULE(_attnoracle, m) {
  // the gate's golden values of a case with the keep mask an implementation drew (check)
  conformance::set_case_evaluator([](const SafeTensorsFile& f) {
    const Case c = case_from_file("<returned dropout_mask>", f);
    return golden_file(c, evaluate(c, {}));
  });
  m.doc() = "The AttnOracle C++ libraries (use the attnoracle package)";
  m.attr("__version__") = std::string(kVersion);
  m.attr("name_and_version") = std::string(kNameAndVersion);
  m.def("set_exception_types", [](py::object input_error, py::object invariant_error) {
    input_error_type = input_error.release().ptr();
    invariant_error_type = invariant_error.release().ptr();
  });
  m.def("encode", &py_encode, py::arg("dtype"), py::arg("values"), py::arg("round"), py::arg("file"), py::arg("field"));
  m.def("decode", &py_decode, py::arg("dtype"), py::arg("data"));
  m.def("is_golden_tensor_name", &is_golden_tensor_name, py::arg("name"));
  m.def("evaluate", &py_evaluate);
  m.def("read_case", &py_read_case);
  m.def("write_case", &py_write_case);
  m.def("write_file", &py_write_file);
  m.def("read_manifest", &py_read_manifest);
  m.def("read_set_case", &py_read_set_case);
  m.def("check", &py_check, py::arg("id"), py::arg("tags"), py::arg("golden_tensors"), py::arg("golden_metadata"),
        py::arg("expect"), py::arg("outcome"), py::arg("reason"), py::arg("result_tensors"), py::arg("profile"),
        py::arg("masked_rows"), py::arg("returns"), py::arg("profile_json") = std::string());
  m.def("declared_metadata", &py_declared_metadata);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InputError& e) {
      if (!input_error_type) throw;
      raise(input_error_type, e.message(), py::str(e.file()), py::str(e.field()));
    } catch (const oracle::InvariantViolation& e) {
      if (!invariant_error_type) throw;
      std::string msg = "invariant violated: " + std::to_string(e.violations().size()) + " violation(s)";
      for (std::size_t k = 0; k < e.violations().size() && k < 20; ++k) msg += "\n  " + e.violations()[k].message();
      raise(invariant_error_type, msg, py::none(), py::none());
    } catch (const fs::filesystem_error& e) {
      if (!input_error_type) throw;
      raise(input_error_type, printable(e.path1().string(), 500) + ": " + printable(e.code().message(), 200),
            py::str(e.path1().string()), py::str(""));
    }
  });
}
