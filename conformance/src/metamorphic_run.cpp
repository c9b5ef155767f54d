// Runs an implementation on problems and their twins, and checks the relations.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/conformance/metamorphic.hpp"

namespace attnoracle::conformance {

PrecisionProfile precision_profile(const std::string& name) {
  if (name == "fp64") return {name, 0x1p-53};
  if (name == "fp32") return {name, 0x1p-24};
  if (name == "fp16") return {name, 0x1p-11};
  if (name == "bf16") return {name, 0x1p-8};
  throw InputError("--profile", "", "unknown profile '" + name + "' (fp64, fp32, fp16, bf16)");
}

namespace {

// Magnitudes of one problem, in double: they scale the error bound of an implementation.
struct Magnitudes {
  std::vector<double> smax;  // [B, H, Nq]: largest |score| over allowed keys
  std::vector<double> vmax;  // sdpa [B, H, Dv]: largest |v_jc|; mha [B, Dout]: bound of |out_e|
  double extra = 0;          // terms added to the row length in the bound (D for mha)

  explicit Magnitudes(const Case& c) {
    const std::int64_t H = c.Hq;
    // Scores and values in double; mha projects first.
    std::vector<double> Q, K, V;
    if (c.kind == Kind::Sdpa) {
      Q = c.q.values, K = c.k.values, V = c.v.values;
    } else {
      auto project = [&](const FloatTensor& x, const FloatTensor& w, std::int64_t N, std::int64_t E) {
        std::vector<double> p(static_cast<std::size_t>(c.B * H * N * E));
        for (std::int64_t b = 0; b < c.B; ++b)
          for (std::int64_t r = 0; r < H; ++r)
            for (std::int64_t n = 0; n < N; ++n)
              for (std::int64_t e = 0; e < E; ++e) {
                double s = 0;
                for (std::int64_t d = 0; d < c.D; ++d)
                  s += x.values[static_cast<std::size_t>((b * N + n) * c.D + d)] *
                       w.values[static_cast<std::size_t>((r * c.D + d) * E + e)];
                p[static_cast<std::size_t>(((b * H + r) * N + n) * E + e)] = s;
              }
        return p;
      };
      Q = project(c.x_q, c.w_q, c.Nq, c.Dk);
      K = project(c.x_kv, c.w_k, c.Nk, c.Dk);
      V = project(c.x_kv, c.w_v, c.Nk, c.Dv);
      extra = static_cast<double>(c.D + H * c.Dv);
    }
    const std::int64_t Hk = c.kind == Kind::Sdpa ? c.Hkv : H;
    const double scale = c.scale ? std::strtod(c.scale->c_str(), nullptr) : 1 / std::sqrt(static_cast<double>(c.Dk));
    const double cap = c.softcap ? std::strtod(c.softcap->c_str(), nullptr) : 0;
    smax.assign(static_cast<std::size_t>(c.B * H * c.Nq), 0);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t g = h / (H / Hk);
        for (std::int64_t i = 0; i < c.Nq; ++i) {
          double m = 0;
          for (std::int64_t j = 0; j < c.Nk; ++j) {
            if (!c.allowed(b, h, i, j)) continue;
            double t = 0;
            for (std::int64_t d = 0; d < c.Dk; ++d)
              t += Q[static_cast<std::size_t>(((b * H + h) * c.Nq + i) * c.Dk + d)] *
                   K[static_cast<std::size_t>(((b * Hk + g) * c.Nk + j) * c.Dk + d)];
            t = std::fabs(t * scale);
            if (cap > 0) t = std::min(t, cap);
            m = std::max(m, t + std::fabs(c.bias_at(b, h, i, j)));
          }
          smax[static_cast<std::size_t>((b * H + h) * c.Nq + i)] = m;
        }
      }
    std::vector<double> vh(static_cast<std::size_t>(c.B * Hk * c.Dv), 0);  // [B, Hk, Dv]
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t g = 0; g < Hk; ++g)
        for (std::int64_t j = 0; j < c.Nk; ++j)
          for (std::int64_t col = 0; col < c.Dv; ++col) {
            double& x = vh[static_cast<std::size_t>((b * Hk + g) * c.Dv + col)];
            x = std::max(x, std::fabs(V[static_cast<std::size_t>(((b * Hk + g) * c.Nk + j) * c.Dv + col)]));
          }
    if (c.kind == Kind::Sdpa) {
      vmax.assign(static_cast<std::size_t>(c.B * H * c.Dv), 0);
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t col = 0; col < c.Dv; ++col)
            vmax[static_cast<std::size_t>((b * H + h) * c.Dv + col)] =
                vh[static_cast<std::size_t>((b * Hk + h / (H / Hk)) * c.Dv + col)];
    } else {
      vmax.assign(static_cast<std::size_t>(c.B * c.Dout), 0);
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t e = 0; e < c.Dout; ++e) {
          double s = 0;
          for (std::int64_t r = 0; r < H; ++r)
            for (std::int64_t col = 0; col < c.Dv; ++col)
              s += vh[static_cast<std::size_t>((b * H + r) * c.Dv + col)] *
                   std::fabs(c.w_o.values[static_cast<std::size_t>((r * c.Dv + col) * c.Dout + e)]);
          vmax[static_cast<std::size_t>(b * c.Dout + e)] = s;
        }
    }
  }
};

double unit_roundoff(DType t) { return std::ldexp(1.0, -float_format(t).precision); }
double finite_abs(double x) { return std::isfinite(x) ? std::fabs(x) : 0; }

struct Tensor {
  std::vector<double> v;
  std::vector<std::int64_t> shape;
  const RawTensor* raw = nullptr;
};

// Reads a result tensor, checking its dtype and shape; an empty optional with `why` otherwise.
bool read_result(const SafeTensorsFile& f, const std::string& name, DType dt,
                 const std::vector<std::int64_t>& shape, Tensor& out, std::string& why) {
  const RawTensor* t = f.find(name);
  if (!t) {
    why = "result has no tensor " + name;
    return false;
  }
  if (t->dtype != dt || t->shape != shape) {
    why = name + " has dtype " + std::string(dtype_name(t->dtype)) + " and the wrong shape or dtype";
    return false;
  }
  out.shape = shape;
  out.raw = t;
  const std::size_t es = dtype_size(dt), n = t->data.size() / es;
  out.v.resize(n);
  for (std::size_t k = 0; k < n; ++k) out.v[k] = decode_float(dt, t->data.data() + k * es);
  return true;
}

bool same_bits(const Tensor& a, std::size_t ia, const Tensor& b, std::size_t ib) {
  const std::size_t es = dtype_size(a.raw->dtype);
  return std::memcmp(a.raw->data.data() + ia * es, b.raw->data.data() + ib * es, es) == 0;
}

struct Comparison {
  RelationResult& r;
  double worst_seen = 0;
  bool bitwise = true;
  // |a - b| <= tol; equal infinities pass; NaN never does.
  void element(const char* tensor, const std::string& where, double a, double b, double tol,
               bool bits_equal) {
    bitwise = bitwise && bits_equal;
    double ratio;
    if (a == b || (std::isinf(a) && a == b)) ratio = 0;
    else if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b)) ratio = INFINITY;
    else ratio = std::fabs(a - b) / tol;
    if (ratio > worst_seen) {
      worst_seen = ratio;
      char buf[256];
      std::snprintf(buf, sizeof buf, "%s%s: %.9g vs %.9g, tolerance %.3g", tensor, where.c_str(), a, b, tol);
      r.detail = buf;
    }
  }
};

std::string idx(std::initializer_list<std::int64_t> ix) {
  std::string s = "[";
  bool first = true;
  for (auto x : ix) {
    s += (first ? "" : ",") + std::to_string(x);
    first = false;
  }
  return s + "]";
}

void compare_pair(const TwinPair& p, const conformance::JobResult& ra, const conformance::JobResult& rb,
                  const MetamorphicOptions& opt, RelationResult& res) {
  using conformance::Outcome;
  using St = RelationResult::Status;
  if (ra.outcome == Outcome::Unsupported || rb.outcome == Outcome::Unsupported) {
    res.status = St::Skipped;
    res.detail = "unsupported: " + (ra.outcome == Outcome::Unsupported ? ra.reason : rb.reason);
    return;
  }
  if (ra.outcome == Outcome::Refused && rb.outcome == Outcome::Refused) {
    res.status = St::Pass;
    res.detail = "both refused";
    return;
  }
  if (ra.outcome != Outcome::Output || rb.outcome != Outcome::Output) {
    res.status = St::Violated;
    auto say = [](const conformance::JobResult& j) {
      return std::string(conformance::outcome_name(j.outcome)) + (j.reason.empty() ? "" : " (" + j.reason + ")");
    };
    res.detail = "problem: " + say(ra) + "; twin: " + say(rb);
    return;
  }
  const Case ca = case_from_file("a", p.a), cb = case_from_file("b", p.b);
  const Magnitudes m(ca);
  const DType odt = ca.output_dtype;
  const double u = opt.profile.u, uo = unit_roundoff(odt), S = opt.safety;
  const bool mha = ca.kind == Kind::Mha;
  const std::int64_t H = ca.Hq, W = mha ? ca.Dout : ca.Dv;
  auto K = [&](std::int64_t b, std::int64_t h, std::int64_t i) {  // the bound's dimensionless size
    return static_cast<double>(ca.Dk + ca.Nk + 4) + m.extra +
           2 * (m.smax[static_cast<std::size_t>((b * H + h) * ca.Nq + i)] + std::fabs(p.lse_shift));
  };
  Comparison cmp{res};
  std::string why;
  Tensor oa, ob;
  const std::vector<std::int64_t> oshape = mha ? std::vector<std::int64_t>{ca.B, ca.Nq, W}
                                               : std::vector<std::int64_t>{ca.B, H, ca.Nq, W};
  if (!read_result(ra.output, "out", odt, oshape, oa, why) || !read_result(rb.output, "out", odt, oshape, ob, why)) {
    res.status = St::Violated;
    res.detail = why;
    return;
  }
  for (std::int64_t b = 0; b < ca.B; ++b)
    for (std::int64_t i = 0; i < ca.Nq; ++i)
      for (std::int64_t h = 0; h < (mha ? 1 : H); ++h) {
        if (mha ? !p.out_rows[static_cast<std::size_t>(b * ca.Nq + i)] : !p.rows[static_cast<std::size_t>((b * H + h) * ca.Nq + i)])
          continue;
        double k = 0;
        for (std::int64_t hh = (mha ? 0 : h); hh < (mha ? H : h + 1); ++hh) k = std::max(k, K(b, hh, i));
        for (std::int64_t e = 0; e < W; ++e) {
          const auto at = static_cast<std::size_t>((mha ? (b * ca.Nq + i) : ((b * H + h) * ca.Nq + i)) * W + e);
          const double vm = mha ? m.vmax[static_cast<std::size_t>(b * W + e)] : m.vmax[static_cast<std::size_t>((b * H + h) * W + e)];
          // each side within (K u vmax + uo |y|) of the exact value, times the safety factor
          const double tol = S * (2 * k * u * vm + uo * (finite_abs(oa.v[at]) + finite_abs(ob.v[at]))) + 1e-300;
          cmp.element("out", mha ? idx({b, i, e}) : idx({b, h, i, e}), oa.v[at], ob.v[at], tol, same_bits(oa, at, ob, at));
        }
      }
  const std::string outputs = p.a.metadata.count("attn.outputs") ? p.a.metadata.at("attn.outputs") : "out";
  if (outputs.find("weights") != std::string::npos) {
    Tensor wa, wb;
    const std::int64_t Nkb = cb.Nk;
    if (!read_result(ra.output, "weights", odt, {ca.B, H, ca.Nq, ca.Nk}, wa, why) ||
        !read_result(rb.output, "weights", odt, {ca.B, H, ca.Nq, Nkb}, wb, why)) {
      res.status = St::Violated;
      res.detail = why;
      return;
    }
    for (std::int64_t b = 0; b < ca.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < ca.Nq; ++i) {
          if (!p.rows[static_cast<std::size_t>((b * H + h) * ca.Nq + i)]) continue;
          const double k = K(b, h, i);
          for (std::int64_t j = 0; j < ca.Nk; ++j) {
            const std::int64_t jt = p.perm.empty() ? j : p.perm[static_cast<std::size_t>(j)];
            const auto ia = static_cast<std::size_t>(((b * H + h) * ca.Nq + i) * ca.Nk + j);
            const auto ib = static_cast<std::size_t>(((b * H + h) * ca.Nq + i) * Nkb + jt);
            const double tol = S * (2 * k * u + uo * (finite_abs(wa.v[ia]) + finite_abs(wb.v[ib]))) + 1e-300;
            cmp.element("weights", idx({b, h, i, j}), wa.v[ia], wb.v[ib], tol, same_bits(wa, ia, wb, ib));
          }
          if (p.extra_key) {  // a masked key's weight is exactly 0 in any sane implementation
            const double w = wb.v[static_cast<std::size_t>(((b * H + h) * ca.Nq + i) * Nkb + ca.Nk)];
            if (w != 0) {
              cmp.worst_seen = INFINITY;
              res.detail = "weights" + idx({b, h, i, ca.Nk}) + " of the masked padding key is " + std::to_string(w) + ", not 0";
            }
          }
        }
  }
  if (outputs.find("lse") != std::string::npos) {
    Tensor la, lb;
    if (!read_result(ra.output, "lse", odt, {ca.B, H, ca.Nq}, la, why) ||
        !read_result(rb.output, "lse", odt, {ca.B, H, ca.Nq}, lb, why)) {
      res.status = St::Violated;
      res.detail = why;
      return;
    }
    for (std::int64_t b = 0; b < ca.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < ca.Nq; ++i) {
          const auto at = static_cast<std::size_t>((b * H + h) * ca.Nq + i);
          if (!p.rows[at]) continue;
          const double a = la.v[at] + p.lse_shift, b2 = lb.v[at];
          const double tol = S * (2 * K(b, h, i) * u * (1 + finite_abs(a)) + uo * (finite_abs(a) + finite_abs(b2))) + 1e-300;
          cmp.element("lse", idx({b, h, i}), a, b2, tol, p.lse_shift == 0 && same_bits(la, at, lb, at));
        }
  }
  res.worst = cmp.worst_seen;
  res.bitwise = cmp.bitwise;
  res.status = cmp.worst_seen <= 1 ? St::Pass : St::Violated;
  if (res.status == St::Pass) res.detail.clear();
}

}  // namespace

MetamorphicReport run_metamorphic(const std::vector<std::pair<std::string, SafeTensorsFile>>& problems,
                                  const MetamorphicOptions& opt) {
  namespace fs = std::filesystem;
  MetamorphicReport rep;
  std::vector<conformance::AdapterJob> jobs;
  struct Pending {
    std::string problem;
    TwinPair pair;
    std::size_t ja, jb;
    std::string fa, fb;
  };
  std::vector<Pending> pend;
  fs::create_directories(opt.work_dir);
  for (const auto& [id, file] : problems) {
    std::map<std::vector<unsigned char>, std::size_t> written;  // same bytes, same job
    auto job_for = [&](const SafeTensorsFile& f, const std::string& tag, std::string& path) {
      std::vector<unsigned char> bytes = serialize_safetensors(f);
      if (auto it = written.find(bytes); it != written.end()) {
        path = jobs[it->second].input;
        return it->second;
      }
      path = (fs::path(opt.work_dir) / (id + "." + tag + ".safetensors")).string();
      write_file_atomic(path, bytes);
      jobs.push_back({id + "." + tag, path, (fs::path(opt.work_dir) / (id + "." + tag + ".out.safetensors")).string()});
      written.emplace(std::move(bytes), jobs.size() - 1);
      return jobs.size() - 1;
    };
    for (TwinPair& p : make_twins(id, file)) {
      Pending q{id, std::move(p), 0, 0, {}, {}};
      q.ja = job_for(q.pair.a, q.pair.tag == "head" && q.pair.a.find("w_o") ? "base-head" : "base", q.fa);
      q.jb = job_for(q.pair.b, q.pair.tag, q.fb);
      pend.push_back(std::move(q));
    }
  }
  const conformance::AdapterRun run =
      conformance::run_adapter(opt.command, jobs, (fs::path(opt.work_dir) / "run").string(), opt.timeout);
  if (run.timed_out || run.signaled || run.exit_status != 0) {
    rep.adapter_note = run.timed_out ? "the implementation timed out"
                                     : "the implementation exited with status " + std::to_string(run.exit_status);
    if (!run.stderr_tail.empty()) rep.adapter_note += "; its last output: " + run.stderr_tail;
  }
  for (Pending& q : pend) {
    RelationResult r;
    r.problem = q.problem;
    r.invariant = q.pair.invariant;
    r.what = q.pair.what;
    compare_pair(q.pair, run.results[q.ja], run.results[q.jb], opt, r);
    if (r.status == RelationResult::Status::Violated && !opt.failures_dir.empty()) {
      fs::create_directories(opt.failures_dir);
      const fs::path a = fs::path(opt.failures_dir) / fs::path(q.fa).filename();
      const fs::path b = fs::path(opt.failures_dir) / fs::path(q.fb).filename();
      fs::copy_file(q.fa, a, fs::copy_options::overwrite_existing);
      fs::copy_file(q.fb, b, fs::copy_options::overwrite_existing);
      r.detail += "; cases: " + a.string() + " and " + b.string();
    }
    switch (r.status) {
      case RelationResult::Status::Pass: ++rep.passed; break;
      case RelationResult::Status::Violated: ++rep.violated; break;
      case RelationResult::Status::Skipped: ++rep.skipped; break;
    }
    if (r.status == RelationResult::Status::Pass && r.bitwise) ++rep.bitwise;
    rep.results.push_back(std::move(r));
  }
  return rep;
}

}  // namespace attnoracle::conformance
