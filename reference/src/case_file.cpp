#include "attnoracle/reference/case_file.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <map>
#include <set>
#include <string_view>

#include "attnoracle/reference/dropout.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/quantized_kv.hpp"
#include "attnoracle/reference/rotary.hpp"

namespace attnoracle {
namespace {

using Shape = std::vector<std::int64_t>;

// The elements of an F32 or F64 tensor widened into v (sized to them); whether they are all
// finite (false for other dtypes: decoded and checked element by element instead). An exponent
// field of all ones (infinite or NaN) plus its lowest bit carries into the sign bit: `bad`'s top
// bit. By whole blocks of 64, which vectorize, then the rest.
bool widened_finite(const RawTensor& t, std::vector<double>& v) {
  if constexpr (std::endian::native != std::endian::little) return false;
  const std::size_t n = v.size();
  double* const out = v.data();
  if (t.dtype == DType::F32) {
    std::uint32_t bad = 0;
    for (std::size_t e0 = 0; e0 < n; e0 += 64) {
      std::uint32_t b[64];
      const std::size_t m = std::min<std::size_t>(64, n - e0);
      std::memcpy(b, t.data.data() + 4 * e0, 4 * m);
      double* const o = out + e0;
      const auto at = [&](std::size_t e) {
        bad |= (b[e] & 0x7f80'0000u) + 0x0080'0000u;
        o[e] = static_cast<double>(std::bit_cast<float>(b[e]));  // exact
      };
      if (m == 64)
        for (std::size_t e = 0; e < 64; ++e) at(e);
      else
        for (std::size_t e = 0; e < m; ++e) at(e);
    }
    return (bad >> 31) == 0;
  }
  if (t.dtype == DType::F64) {
    std::memcpy(out, t.data.data(), n * 8);
    std::uint64_t bad = 0;
    for (std::size_t e0 = 0; e0 < n; e0 += 64) {
      std::uint64_t b[64];
      const std::size_t m = std::min<std::size_t>(64, n - e0);
      std::memcpy(b, out + e0, 8 * m);
      if (m == 64)
        for (std::size_t e = 0; e < 64; ++e) bad |= (b[e] & 0x7ff0'0000'0000'0000u) + 0x0010'0000'0000'0000u;
      else
        for (std::size_t e = 0; e < m; ++e) bad |= (b[e] & 0x7ff0'0000'0000'0000u) + 0x0010'0000'0000'0000u;
    }
    return (bad >> 63) == 0;
  }
  return false;
}

constexpr std::array<std::string_view, 10> kMetadataKeys = {
    "attn.format",  "attn.kind",        "attn.scale",        "attn.causal",        "attn.window",
    "attn.softcap", "attn.masked_rows", "attn.output_dtype", "attn.output_dtypes", "attn.outputs"};
// Split-KV partial states and kind merge (CONTRACT section 8).
constexpr std::array<std::string_view, 2> kSplitKvKeys = {"attn.kv_split_size", "attn.lse_posinf"};
// Written by the reference beside golden tensors; dropped on reading, like those tensors.
constexpr std::array<std::string_view, 2> kReferenceKeys = {"attn.reference", "attn.undecided"};

std::string quoted(std::string_view s) { return "\"" + printable(s) + "\""; }

std::string decimal(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// A number as strtod reads it (decimal or C hex float), the whole text, no leading space.
struct Number {
  double value = 0;
  bool underflow = false;  // nonzero text that reads as 0 or a subnormal
  bool overflow = false;   // finite text beyond the F64 range
};
std::optional<Number> parse_number(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  Number n;
  n.value = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) return std::nullopt;
  n.underflow = errno == ERANGE && std::fabs(n.value) < 1;
  n.overflow = errno == ERANGE && std::isinf(n.value);  // a finite text beyond F64's range
  return n;
}

std::optional<std::int64_t> parse_count(std::string_view text) {
  if (text.empty() || text.size() > 18) return std::nullopt;  // 18 digits fit in int64
  std::int64_t n = 0;
  for (char ch : text) {
    if (ch < '0' || ch > '9') return std::nullopt;
    n = n * 10 + (ch - '0');
  }
  return n;
}

class CaseReader {
 public:
  CaseReader(const std::string& path, Case& c) : path_(path), c_(c) {}

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw InputError(path_, field, what);
  }

  [[noreturn]] void bad(const char* key, const std::string& value,
                        const std::string& expected) const {
    fail(key, "value " + quoted(value) + " is not " + expected);
  }

  void metadata(const std::map<std::string, std::string>& md) {
    for (const auto& [key, value] : md) {
      if (key.rfind("attn.", 0) != 0) continue;
      if (key == kKvLayoutKey || key == kKvBlockScaleKey || key == kVFromKKey || key == kDropoutPKey ||
          key == kRotaryKey || key == kRotaryRoundKey)
        continue;
      if (std::find(kMetadataKeys.begin(), kMetadataKeys.end(), key) != kMetadataKeys.end() ||
          std::find(kReferenceKeys.begin(), kReferenceKeys.end(), key) != kReferenceKeys.end() ||
          std::find(kSplitKvKeys.begin(), kSplitKvKeys.end(), key) != kSplitKvKeys.end())
        continue;
      std::string_view nearest;
      std::size_t distance = 3;  // suggest only keys within 2 edits
      for (auto known : kMetadataKeys)
        if (const auto d = edit_distance(key, known); d < distance) {
          nearest = known;
          distance = d;
        }
      fail(printable(key), nearest.empty()
                               ? std::string("unknown key")
                               : "unknown key (did you mean " + std::string(nearest) + "?)");
    }
    auto get = [&](const char* key) -> const std::string* {
      auto it = md.find(key);
      return it == md.end() ? nullptr : &it->second;
    };
    const std::string* v = get("attn.format");
    if (!v) fail("attn.format", "missing (required; this reader knows format 1)");
    if (*v != "1") fail("attn.format", "format " + quoted(*v) + " is not supported (only 1)");

    // An enum by its name, and a finite number, when the key is present.
    auto named = [&](const char* key, auto from_name, const char* expected, auto& field) {
      if (const std::string* s = get(key)) {
        const auto e = from_name(*s);
        if (!e) bad(key, *s, expected);
        field = *e;
      }
    };
    auto number = [&](const char* key) -> std::optional<Number> {
      const std::string* s = get(key);
      if (!s) return std::nullopt;
      const auto n = parse_number(*s);
      if (!n) bad(key, *s, "a number (decimal or C hex float)");
      if (n->overflow)
        bad(key, *s, "a number of magnitude at most 0x1.fffffffffffffp+1023 (the F64 range)");
      if (!std::isfinite(n->value)) bad(key, *s, "a finite number");
      return n;
    };
    named("attn.kind", kind_from_name, "sdpa, mha or merge", c_.kind);
    for (auto key : {kKvBlockScaleKey, kVFromKKey})  // stored K/V (CONTRACT section 9)
      if (c_.kind != Kind::Sdpa && get(std::string(key).c_str()))
        fail(std::string(key), "is for attn.kind sdpa only");
    if (c_.kind == Kind::Merge) merge_metadata(get);
    if (number("attn.scale")) c_.scale = *get("attn.scale");
    named("attn.causal", causal_from_name, "none, top_left or bottom_right", c_.causal);
    if ((v = get("attn.window")) && *v != "none") {
      const auto comma = v->find(',');
      std::optional<std::int64_t> left, right;
      if (comma != std::string::npos) {
        left = parse_count(std::string_view(*v).substr(0, comma));
        right = parse_count(std::string_view(*v).substr(comma + 1));
      }
      if (!left || !right)
        bad("attn.window", *v,
            "none or L,R with L and R non-negative integers (at most 18 digits)");
      c_.window = true;
      c_.window_left = *left;
      c_.window_right = *right;
    }
    if (const auto n = number("attn.softcap")) {
      const bool nonzero = n->value != 0 || n->underflow;
      if (std::signbit(n->value) && nonzero)
        bad("attn.softcap", *get("attn.softcap"), "a number >= 0");
      if (nonzero) c_.softcap = *get("attn.softcap");  // exactly 0 means off
    }
    named("attn.masked_rows", masked_rows_from_name, "error or zero", c_.masked_rows);
    if ((v = get("attn.output_dtype"))) {
      auto t = dtype_from_name(*v);
      if (!t || !(is_float_format(*t) || is_fp8(*t)))
        bad("attn.output_dtype", *v, "F64, F32, F16, BF16, F8_E4M3 or F8_E5M2");
      if (is_fp8(*t) && c_.kind != Kind::Sdpa)
        fail("attn.output_dtype", "value " + quoted(*v) + " is for attn.kind sdpa only");
      output_dtype_ = *t;
    }
    std::set<std::string> listed = {"out"};
    if ((v = get("attn.outputs"))) {
      listed.clear();
      std::string_view rest = *v;
      while (true) {
        const auto comma = rest.find(',');
        const std::string name(rest.substr(0, comma));
        static const std::set<std::string> known = {"out",  "weights", "lse",  "scores", "dq",   "dk",
                                                    "dv",   "dbias",   "dsinks", "dx_q", "dx_kv", "dw_q",
                                                    "dw_k", "dw_v",    "dw_o", "out_partial", "lse_partial",
                                                    "amax"};
        if (!known.count(name))
          bad("attn.outputs", *v,
              "a comma list of out, weights, lse, scores, dq, dk, dv, dbias, dsinks, dx_q, dx_kv, dw_q, "
              "dw_k, dw_v, dw_o, out_partial, lse_partial, amax (" + quoted(name) + "?)");
        if (!listed.insert(name).second)
          bad("attn.outputs", *v, "a list without repeats (" + quoted(name) + " twice)");
        if (comma == std::string_view::npos) break;
        rest.remove_prefix(comma + 1);
      }
      c_.want_weights = listed.count("weights") > 0;
      c_.want_lse = listed.count("lse") > 0;
      c_.want_scores = listed.count("scores") > 0;
      c_.want_dq = listed.count("dq") > 0;
      c_.want_dk = listed.count("dk") > 0;
      c_.want_dv = listed.count("dv") > 0;
      c_.want_dbias = listed.count("dbias") > 0;
      c_.want_dsinks = listed.count("dsinks") > 0;
      c_.want_dx_q = listed.count("dx_q") > 0;
      c_.want_dx_kv = listed.count("dx_kv") > 0;
      c_.want_dw_q = listed.count("dw_q") > 0;
      c_.want_dw_k = listed.count("dw_k") > 0;
      c_.want_dw_v = listed.count("dw_v") > 0;
      c_.want_dw_o = listed.count("dw_o") > 0;
      c_.want_out_partial = listed.count("out_partial") > 0;
      c_.want_lse_partial = listed.count("lse_partial") > 0;
      c_.want_amax = listed.count("amax") > 0;
      for (const char* g : {"dq", "dk", "dv"})
        if (listed.count(g) && c_.kind == Kind::Mha)
          fail("attn.outputs", "value " + quoted(*v) + " asks for " + g +
                                   ", a gradient of kind sdpa; kind mha has dx_q, dx_kv, dw_q, dw_k, dw_v and dw_o");
      for (const char* g : {"dx_q", "dx_kv", "dw_q", "dw_k", "dw_v", "dw_o"})
        if (listed.count(g) && c_.kind == Kind::Sdpa)
          fail("attn.outputs", "value " + quoted(*v) + " asks for " + g +
                                   ", a gradient of kind mha; kind sdpa has dq, dk and dv");
    }
    listed.insert("out");  // out is always written
    split_kv(get, v);
    if ((v = get("attn.output_dtypes"))) output_dtypes(*v, listed);
    fp8_output(listed, get("attn.outputs"));
  }

  // FP8 out (CONTRACT section 9): the other outputs are F32 unless attn.output_dtypes says; no
  // gradients. amax only with it.
  void fp8_output(const std::set<std::string>& listed, const std::string* outputs) {
    if (!output_dtype_ || !is_fp8(*output_dtype_)) {
      if (c_.want_amax)
        fail("attn.outputs", "value " + quoted(*outputs) + " asks for amax, which needs attn.output_dtype " +
                                 "F8_E4M3 or F8_E5M2");
      return;
    }
    if (c_.wants_gradients())
      fail("attn.outputs", "value " + quoted(*outputs) + " asks for gradients, which FP8 outputs (attn.output_dtype " +
                               std::string(dtype_name(*output_dtype_)) + ") do not have");
    std::set<std::string> others = listed;
    if (c_.wants_partials()) others.insert({"out_partial", "lse_partial"});  // asked as a pair
    for (const std::string& name : others)
      if (name != "out" && name != "amax" && std::none_of(c_.output_dtypes.begin(), c_.output_dtypes.end(),
                                                          [&](const auto& e) { return e.first == name; }))
        c_.output_dtypes.emplace_back(name, DType::F32);
  }

  // attn.kv_split_size and the partial outputs (CONTRACT section 8): a split size n >= 1 on an
  // sdpa case; partials need it and come without gradients.
  template <class Get>
  void split_kv(const Get& get, const std::string* outputs) {
    if (const std::string* s = get("attn.kv_split_size")) {
      const auto n = parse_count(*s);
      if (!n || *n < 1) bad("attn.kv_split_size", *s, "an integer >= 1 (at most 18 digits)");
      if (c_.kind != Kind::Sdpa) fail("attn.kv_split_size", "is for attn.kind sdpa only");
      c_.kv_split_size = *n;
    }
    if (get("attn.lse_posinf") && c_.kind != Kind::Merge)
      fail("attn.lse_posinf", "is for attn.kind merge only");
    if (!c_.wants_partials()) return;
    const std::string asked = c_.want_out_partial ? "out_partial" : "lse_partial";
    if (c_.kind != Kind::Sdpa)
      fail("attn.outputs", "value " + quoted(*outputs) + " asks for " + asked + ", which kind " +
                               std::string(kind_name(c_.kind)) + " does not have (kind sdpa only)");
    if (!c_.kv_split_size)
      fail("attn.outputs", "value " + quoted(*outputs) + " asks for " + asked +
                               " but attn.kv_split_size is missing");
    if (c_.wants_gradients())
      fail("attn.outputs", "value " + quoted(*outputs) + " asks for " + asked +
                               " and gradients; partial states have no gradients");
  }

  // Kind merge takes none of the options of attention itself; attn.lse_posinf says how +inf in
  // lse_partial reads.
  template <class Get>
  void merge_metadata(const Get& get) {
    for (const char* key : {"attn.scale", "attn.causal", "attn.window", "attn.softcap", "attn.kv_split_size", kDropoutPKey})
      if (get(key)) fail(key, "is not an option of attn.kind merge");
    if (const std::string* s = get("attn.lse_posinf")) {
      if (*s != "empty" && *s != "error") bad("attn.lse_posinf", *s, "error or empty");
      c_.lse_posinf_empty = *s == "empty";
    }
    if (const std::string* s = get("attn.outputs"))
      for (const char* name : {"weights", "scores", "dq", "dk", "dv", "dbias", "dsinks", "out_partial", "lse_partial"})
        if (("," + *s + ",").find(std::string(",") + name + ",") != std::string::npos)
          fail("attn.outputs", "value " + quoted(*s) + " asks for " + name +
                                   ", which kind merge does not have (out and lse only)");
  }

  // attn.output_dtypes: a comma list of name:DTYPE, each name an output that attn.outputs asks
  // for, once.
  void output_dtypes(const std::string& v, const std::set<std::string>& asked) {
    std::string_view rest = v;
    while (true) {
      const auto comma = rest.find(',');
      const std::string_view entry = rest.substr(0, comma);
      const auto colon = entry.find(':');
      if (colon == std::string_view::npos)
        bad("attn.output_dtypes", v, "a comma list of name:DTYPE, e.g. lse:F32 (" + quoted(entry) + "?)");
      const std::string name(entry.substr(0, colon)), type(entry.substr(colon + 1));
      if (!asked.count(name))
        fail("attn.output_dtypes", "value " + quoted(v) + " gives a dtype to " + quoted(name) +
                                       ", which is not an output attn.outputs asks for");
      const auto t = dtype_from_name(type);
      if (!t || !is_float_format(*t))
        bad("attn.output_dtypes", v, "a list of name:DTYPE with DTYPE F64, F32, F16 or BF16 (" + quoted(type) + "?)");
      for (const auto& [n, _] : c_.output_dtypes)
        if (n == name) bad("attn.output_dtypes", v, "a list without repeats (" + quoted(name) + " twice)");
      c_.output_dtypes.emplace_back(name, *t);
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }

  void tensors(const SafeTensorsFile& file) {
    static const std::set<std::string> sdpa = {"q", "k", "v"};
    static const std::set<std::string> mha = {"x_q", "x_kv", "w_q", "w_k", "w_v", "w_o"};
    static const std::set<std::string> optional = {"mask", "bias", "query_mask", "seqlens_q",
                                                   "seqlens_k", "sinks", "dout", kDropoutMaskName,
                                                   kRotaryCosName, kRotarySinName};
    static const std::set<std::string> descales = {"q_descale", "k_descale", "v_descale"};
    if (c_.kind != Kind::Sdpa) apply_rotary(path_, file, c_);  // refuses any rotary input
    if (c_.kind == Kind::Merge) return merge_inputs(file);
    const bool is_sdpa = c_.kind == Kind::Sdpa;
    const auto& mine = is_sdpa ? sdpa : mha;
    const auto& theirs = is_sdpa ? mha : sdpa;
    for (const auto& t : file.tensors) {
      consistent(t);
      if (mine.count(t.name) || optional.count(t.name) || (is_sdpa && descales.count(t.name)) ||
          (is_sdpa && (is_paged_tensor_name(t.name) || is_kv_scale_tensor_name(t.name) || t.name == "o_scale")))
        continue;
      if (is_paged_tensor_name(t.name))
        fail(t.name, "is an input of kind sdpa (a paged KV cache) but attn.kind is mha");
      if (theirs.count(t.name))
        fail(t.name, std::string("is an input of kind ") + (is_sdpa ? "mha" : "sdpa") +
                         " but attn.kind is " + (is_sdpa ? "sdpa" : "mha"));
      fail(printable(t.name),
           is_sdpa ? "unknown tensor (expected q, k, v, and optionally mask, bias, query_mask, seqlens_q, seqlens_k, "
                     "sinks, dout, dropout_mask, rotary_cos, rotary_sin, q_descale, k_descale, v_descale, o_scale, "
                     "k_cache, v_cache, block_table, k_scale, v_scale, k_block_scale, v_block_scale, "
                     "k_global_scale, v_global_scale)"
                   : "unknown tensor (expected x_q, x_kv, w_q, w_k, w_v, w_o, and optionally mask, bias, query_mask, "
                     "seqlens_q, seqlens_k, sinks, dout, dropout_mask)");
    }
    file_ = &file;
    if (is_sdpa)
      sdpa_inputs();
    else
      mha_inputs();
    if (!c_.paged && file.metadata.count(std::string(kKvLayoutKey)))
      fail(std::string(kKvLayoutKey), "given, but the case has no paged KV cache (k_cache, v_cache, block_table)");
    if (is_fp8(c_.input_dtype)) {
      const std::string in(dtype_name(c_.input_dtype));
      if (!is_sdpa) fail(first_input_, "dtype " + in + " is for attn.kind sdpa only");
      if (!output_dtype_)
        fail("attn.output_dtype", "missing (required for " + in + " inputs: F32, F16 or BF16)");
      if (*output_dtype_ == DType::F64)
        bad("attn.output_dtype", "F64", "F32, F16, BF16 or FP8 (the output dtypes of " + in + " inputs)");
      for (const auto& [n, t] : c_.output_dtypes)
        if (t == DType::F64)
          fail("attn.output_dtypes", "gives " + n + " dtype F64, which is not F32, F16 or BF16 (the output dtypes of " +
                                         in + " inputs)");
    }
    if (c_.kv_form && c_.kv_form->scheme != KvScheme::Plain && !output_dtype_)
      fail("attn.output_dtype", "missing (required for " +
                                    (c_.kv_form->scheme == KvScheme::Scaled
                                         ? "scaled " + std::string(dtype_name(c_.kv_form->stored)) + " K/V"
                                         : "attn.kv_block_scale " + std::string(kv_scheme_name(c_.kv_form->scheme))) +
                                    ")");
    c_.output_dtype = output_dtype_.value_or(c_.input_dtype);
    output_scale(file);
    if (is_sdpa) apply_descales(file);

    const std::array<std::int64_t, 4> full = {c_.B, c_.Hq, c_.Nq, c_.Nk};
    // mask and bias broadcast to [B,Hq,Nq,Nk] by NumPy's rules (CONTRACT section 1).
    if (const RawTensor* t = file.find("mask")) {
      expect_dtype(*t, DType::BOOL);
      expect_broadcast(*t, full);
      c_.mask = bools(*t);
    }
    if (const RawTensor* t = file.find("bias")) {
      if (t->dtype != DType::F64 && t->dtype != DType::F32 && t->dtype != c_.input_dtype)
        fail("bias", "dtype " + std::string(dtype_name(t->dtype)) + " is not F64, F32 or " +
                         std::string(dtype_name(c_.input_dtype)) + " (the input dtype)");
      expect_broadcast(*t, full);
      c_.bias = floats(*t, true, is_sdpa);
    }
    if (const RawTensor* t = file.find("query_mask")) {
      expect_dtype(*t, DType::BOOL);
      expect_shape(*t, {c_.B, c_.Nq}, "[B,Nq]");
      c_.query_mask = bools(*t);
    }
    if (const RawTensor* t = file.find("seqlens_q")) c_.seqlens_q = lengths(*t, c_.Nq, "Nq");
    if (const RawTensor* t = file.find("seqlens_k")) c_.seqlens_k = lengths(*t, c_.Nk, "Nk");
    if (const RawTensor* t = file.find("sinks")) {
      if (t->dtype != DType::F64 && t->dtype != DType::F32 && t->dtype != c_.input_dtype)
        fail("sinks", "dtype " + std::string(dtype_name(t->dtype)) + " is not F64, F32 or " +
                          std::string(dtype_name(c_.input_dtype)) + " (the input dtype)");
      expect_shape(*t, {c_.Hq}, is_sdpa ? "[Hq]" : "[H]");
      c_.sinks = floats(*t, false);
    }
    rotary(file);
    if (!unchecked_.empty()) unused_positions();
    gradient_inputs(file);
    dropout(file, full);
  }

 private:
  // Dropout (CONTRACT section 10): dropout_mask (BOOL, broadcastable to [B,Hq,Nq,Nk]) and
  // attn.dropout_p (p in [0, 1)) come together, on a case of kind sdpa without partial states.
  void dropout(const SafeTensorsFile& file, const std::array<std::int64_t, 4>& full) {
    const RawTensor* t = file.find(kDropoutMaskName);
    const auto& md = file.metadata;
    const auto key = md.find(kDropoutPKey);
    const std::string* p = key == md.end() ? nullptr : &key->second;
    if (!t && !p) return;
    if (c_.kind != Kind::Sdpa) fail(t ? kDropoutMaskName : kDropoutPKey, "is for attn.kind sdpa only");
    if (!t) fail(kDropoutPKey, "given, but the case has no dropout_mask tensor (the keep mask)");
    if (!p) fail(kDropoutMaskName, "given, but attn.dropout_p is missing (write 0 for a mask without scaling)");
    const auto n = parse_number(*p);
    if (!n) bad(kDropoutPKey, *p, "a number (decimal or C hex float)");
    if (!dropout_p_in_range(*p)) bad(kDropoutPKey, *p, "a number in [0, 1)");
    expect_dtype(*t, DType::BOOL);
    expect_broadcast(*t, full);
    if (c_.wants_partials())
      fail(kDropoutMaskName, "given, but attn.outputs asks for partial states, which dropout does not have");
    c_.dropout = Case::Dropout{*p, bools(*t)};
  }

  // Rotary embedding (CONTRACT section 10): q and k rotated in place (rotary.cpp); a pair with a
  // non-finite element is NaN after it, both elements then left to the unused-position rules.
  void rotary(const SafeTensorsFile& file) {
    apply_rotary(path_, file, c_);
    if (!c_.rotary) return;
    for (auto [name, t] : {std::pair{"q", &c_.q}, std::pair{"k", &c_.k}}) {
      auto& list = unchecked_[name];
      list.clear();
      for (std::size_t e = 0; e < t->values.size(); ++e)
        if (!std::isfinite(t->values[e])) list.push_back(e);
    }
  }

  // dout (CONTRACT section 7): the shape of out, finite except on padding rows (zeroed there);
  // required when a gradient is asked. dbias needs a bias, dsinks sinks.
  void gradient_inputs(const SafeTensorsFile& file) {
    if (c_.want_dbias && !c_.bias)
      fail("attn.outputs", "dbias is asked but the case has no bias tensor");
    if (c_.want_dsinks && !c_.sinks)
      fail("attn.outputs", "dsinks is asked but the case has no sinks tensor");
    if (c_.wants_gradients() && c_.paged)
      fail("attn.outputs", "asks for gradients, which are not defined for a paged KV cache "
                           "(k_cache, v_cache, block_table)");
    if (c_.wants_gradients() && c_.kv_form)
      fail("attn.outputs", "asks for gradients, which are not defined for " +
                               (c_.kv_form->v_from_k ? std::string("attn.v_from_k")
                                                     : std::string(kv_scheme_name(c_.kv_form->scheme)) + " K/V"));
    if (c_.wants_gradients() && is_fp8(c_.input_dtype))
      fail("attn.outputs", "asks for gradients, but gradients of " +
                               std::string(dtype_name(c_.input_dtype)) + " inputs are not supported");
    const RawTensor* t = file.find("dout");
    if (c_.want_dx_kv && c_.self_attention)
      fail("attn.outputs", "dx_kv is asked but the case is self-attention (x_kv equals x_q): dx_q holds "
                           "the whole gradient of x");
    const char* asked = c_.want_dq ? "dq" : c_.want_dk ? "dk" : c_.want_dv ? "dv"
                      : c_.want_dbias ? "dbias" : c_.want_dsinks ? "dsinks" : c_.want_dx_q ? "dx_q"
                      : c_.want_dx_kv ? "dx_kv" : c_.want_dw_q ? "dw_q" : c_.want_dw_k ? "dw_k"
                      : c_.want_dw_v ? "dw_v" : "dw_o";
    if (!t) {
      if (c_.wants_gradients())
        fail("dout", std::string("missing (required when attn.outputs asks for a gradient: ") +
                         asked + ")");
      return;
    }
    if (t->dtype != DType::F64 && t->dtype != DType::F32 && t->dtype != c_.input_dtype)
      fail("dout", "dtype " + std::string(dtype_name(t->dtype)) + " is not F64, F32 or " +
                       std::string(dtype_name(c_.input_dtype)) + " (the input dtype)");
    const bool mha = c_.kind == Kind::Mha;
    expect_shape(*t, c_.out_shape(), mha ? "the shape of out [B,Nq,Dout]" : "the shape of out [B,Hq,Nq,Dv]");
    c_.dout = floats(*t, false, true);
    for (std::size_t e : unchecked_["dout"]) {
      const auto r = static_cast<std::int64_t>(e) / (mha ? c_.Dout : c_.Dv);  // (b * Hq + h) * Nq + i, or b * Nq + i
      const std::int64_t b = r / (mha ? c_.Nq : c_.Hq * c_.Nq), h = mha ? 0 : r / c_.Nq % c_.Hq, i = r % c_.Nq;
      if (c_.query_valid(b, i))
        fail("dout", "element " + std::to_string(e) + " is " + non_finite_name(c_.dout->values[e]) +
                         ", in query " + std::to_string(i) + " of b=" + std::to_string(b) +
                         (mha ? std::string() : ", h=" + std::to_string(h)) +
                         ", which is not padding (non-finite values are allowed only on padding "
                         "rows)");
      c_.dout->values[e] = 0;  // a padding row contributes nothing
    }
  }

  // A file built in memory (not read) may hold anything: shape and bytes must agree.
  void consistent(const RawTensor& t) const {
    std::uint64_t bytes = dtype_size(t.dtype);
    bool ok = true;
    for (auto d : t.shape)
      ok = ok && d >= 0 && !__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(d), &bytes);
    if (!ok || bytes != t.data.size())
      fail(printable(t.name), "shape " + shape_string(t.shape) + " does not match its " +
                                  std::to_string(t.data.size()) + " bytes of data");
  }

  const RawTensor& required(const std::string& name) {
    const RawTensor* t = file_->find(name);
    if (!t)
      fail(name, std::string("missing (required for attn.kind ") +
                     (c_.kind == Kind::Sdpa ? "sdpa" : "mha") + ")");
    return *t;
  }

  // Checks dtype and shape of a required floating input; the first one fixes the input dtype.
  // Axes 0 and 2 of [B,H,N,D]: B, Nq and Nk may be 0 (CONTRACT section 8, empty shapes).
  static constexpr unsigned kBatchAndRows = 0b0101;

  const RawTensor& input(const std::string& name, std::size_t rank, const char* layout,
                         unsigned may_be_empty = 0) {
    const RawTensor& t = required(name);
    if (!is_input_format(t.dtype))
      fail(name, "dtype " + std::string(dtype_name(t.dtype)) +
                     " is not supported (inputs must be F64, F32, F16, BF16, F8_E4M3 or F8_E5M2)");
    if (first_input_.empty()) {
      first_input_ = name;
      c_.input_dtype = t.dtype;
    } else if (t.dtype != c_.input_dtype) {
      fail(name, "dtype " + std::string(dtype_name(t.dtype)) + " differs from " + first_input_ +
                     "'s " + std::string(dtype_name(c_.input_dtype)));
    }
    expect_rank(t, rank, rank, layout, may_be_empty);
    return t;
  }

  void expect_dtype(const RawTensor& t, DType want) const {
    if (t.dtype != want)
      fail(t.name, "dtype " + std::string(dtype_name(t.dtype)) + " is not " +
                       std::string(dtype_name(want)));
  }

  // Every dimension at least 1, but those of the axes set in `may_be_empty` (bit a: axis a).
  void expect_rank(const RawTensor& t, std::size_t lo, std::size_t hi, const char* layout,
                   unsigned may_be_empty = 0) const {
    const std::size_t r = t.shape.size();
    if (r < lo || r > hi) {
      const std::string want =
          lo == hi ? std::to_string(lo) : std::to_string(lo) + " to " + std::to_string(hi);
      fail(t.name, "shape " + shape_string(t.shape) + " has rank " + std::to_string(r) +
                       ", expected " + want + " " + layout);
    }
    for (std::size_t a = 0; a < r; ++a)
      if (t.shape[a] < 1 && !(may_be_empty >> a & 1))
        fail(t.name, "shape " + shape_string(t.shape) + " has dimension " + std::to_string(a) +
                         " equal to 0; every dimension must be at least 1");
  }

  void expect_shape(const RawTensor& t, const Shape& want, const char* layout) const {
    unsigned empty = 0;  // a dimension the case has as 0 (an empty shape) may be 0 here
    for (std::size_t a = 0; a < want.size(); ++a) empty |= (want[a] == 0 ? 1u : 0u) << a;
    expect_rank(t, want.size(), want.size(), layout, empty);
    if (t.shape != want)
      fail(t.name,
           "shape " + shape_string(t.shape) + " is not " + layout + " = " + shape_string(want));
  }

  // Dimension `axis` of t, named `dim`, must equal dimension `other_axis` of `other`.
  struct Same {
    const RawTensor& t;
    std::size_t axis;
    const char* dim;
    const RawTensor& other;
    std::size_t other_axis;
  };
  void expect_same(std::initializer_list<Same> checks) const {
    for (const Same& s : checks)
      if (s.t.shape[s.axis] != s.other.shape[s.other_axis])
        fail(s.t.name, std::string(s.dim) + " is " + std::to_string(s.t.shape[s.axis]) +
                           " but " + s.other.name + " has " + s.dim + " " +
                           std::to_string(s.other.shape[s.other_axis]));
  }

  // NumPy broadcasting to [B,Hq,Nq,Nk]: rank 0 to 4, right-aligned, each dimension 1 or the
  // full size.
  void expect_broadcast(const RawTensor& t, const std::array<std::int64_t, 4>& full) const {
    static constexpr std::array<const char*, 4> names = {"B", "Hq", "Nq", "Nk"};
    const std::size_t r = t.shape.size();
    unsigned empty = 0;  // dimensions of an empty shape (B, Nq or Nk = 0)
    for (std::size_t a = 0; a < r && r <= 4; ++a) empty |= (full[4 - r + a] == 0 ? 1u : 0u) << a;
    expect_rank(t, 0, 4, "broadcastable to [B,Hq,Nq,Nk]", empty);
    for (std::size_t a = 0; a < r; ++a) {
      const std::size_t f = 4 - r + a;
      if (t.shape[a] != 1 && t.shape[a] != full[f])
        fail(t.name, "shape " + shape_string(t.shape) + " does not broadcast to [B,Hq,Nq,Nk] = " +
                         shape_string(Shape(full.begin(), full.end())) + ": dimension " +
                         std::to_string(a) + " is " + std::to_string(t.shape[a]) +
                         ", must be 1 or " + names[f] + " = " + std::to_string(full[f]));
    }
  }

  static std::string non_finite_name(double x) {
    return std::isnan(x) ? "NaN" : x > 0 ? "+infinity" : "-infinity";
  }

  // Decodes t. A non-finite element (other than -inf when allowed) is refused, or, when
  // `lenient`, recorded in `unchecked_` for the unused-position rules.
  FloatTensor floats(const RawTensor& t, bool allow_minus_inf, bool lenient = false) {
    FloatTensor out;
    out.dtype = t.dtype;
    out.shape = t.shape;
    const std::size_t size = dtype_size(t.dtype);
    const auto n = static_cast<std::size_t>(t.numel());
    reserve_large(out.values, n);
    out.values.resize(n);
    if (widened_finite(t, out.values)) return out;
    for (std::size_t e = 0; e < n; ++e) {
      const double x = decode_float(t.dtype, t.data.data() + e * size);
      out.values[e] = x;
      if (std::isfinite(x) || (allow_minus_inf && x == -std::numeric_limits<double>::infinity()))
        continue;
      if (lenient) {
        unchecked_[t.name].push_back(e);
        continue;
      }
      fail(t.name, "element " + std::to_string(e) + " is " + non_finite_name(x) +
                       (allow_minus_inf ? " (only -infinity is allowed)" : ""));
    }
    return out;
  }

  BoolTensor bools(const RawTensor& t) const {
    BoolTensor out;
    out.shape = t.shape;
    out.values = t.data;
    for (std::size_t e = 0; e < out.values.size(); ++e)
      if (out.values[e] > 1)
        fail(t.name, "element " + std::to_string(e) + " is " + std::to_string(out.values[e]) +
                         "; BOOL elements must be 0 or 1");
    return out;
  }

  // seqlens_q or seqlens_k: [B] of I32 or I64, each in [0, limit].
  std::vector<std::int64_t> lengths(const RawTensor& t, std::int64_t limit,
                                    const char* dim) const {
    if (t.dtype != DType::I32 && t.dtype != DType::I64)
      fail(t.name, "dtype " + std::string(dtype_name(t.dtype)) + " is not I32 or I64");
    if (t.shape != Shape{c_.B})
      fail(t.name, "shape " + shape_string(t.shape) + " is not [B] = " + shape_string({c_.B}));
    std::vector<std::int64_t> out(static_cast<std::size_t>(c_.B));
    for (std::size_t e = 0; e < out.size(); ++e) {
      if (t.dtype == DType::I32) {
        std::int32_t x;
        std::memcpy(&x, t.data.data() + 4 * e, 4);
        out[e] = x;
      } else {
        std::memcpy(&out[e], t.data.data() + 8 * e, 8);
      }
      if (out[e] < 0)
        fail(t.name, "element " + std::to_string(e) + " is " + std::to_string(out[e]) +
                         "; sequence lengths must be at least 0");
      if (out[e] > limit)
        fail(t.name, "element " + std::to_string(e) + " is " + std::to_string(out[e]) + ", more than " +
                         dim + " = " + std::to_string(limit));
    }
    return out;
  }

  // Decodes each input into its field of the case, in order.
  void decode(std::initializer_list<std::pair<const RawTensor*, FloatTensor*>> inputs,
              bool lenient) {
    for (const auto& [t, field] : inputs) *field = floats(*t, false, lenient);
  }

  void sdpa_inputs() {
    const RawTensor& q = input("q", 4, "[B,Hq,Nq,Dk]", kBatchAndRows);
    if (uses_kv_form(*file_, q.dtype)) return stored_kv_inputs(q);
    if (is_paged_file(*file_)) return paged_inputs(q);
    const RawTensor& k = input("k", 4, "[B,Hkv,Nk,Dk]", kBatchAndRows);
    const RawTensor& v = input("v", 4, "[B,Hkv,Nk,Dv]", kBatchAndRows);
    expect_same({{k, 0, "B", q, 0}, {k, 3, "Dk", q, 3}, {v, 0, "B", q, 0}, {v, 1, "Hkv", k, 1},
                 {v, 2, "Nk", k, 2}});
    if (q.shape[1] % k.shape[1] != 0)
      fail("k", "Hkv is " + std::to_string(k.shape[1]) + ", which does not divide Hq " +
                    std::to_string(q.shape[1]) + " of q");
    c_.B = q.shape[0], c_.Hq = q.shape[1], c_.Nq = q.shape[2], c_.Dk = q.shape[3];
    c_.Hkv = k.shape[1], c_.Nk = k.shape[2], c_.Dv = v.shape[3];
    decode({{&q, &c_.q}, {&k, &c_.k}, {&v, &c_.v}}, true);
  }

  // A paged KV cache: the caches gathered into k and v (their bytes, so that everything after
  // reads them as it reads a contiguous case's), the layout kept for messages and the oracle.
  void paged_inputs(const RawTensor& q) {
    const auto& md = file_->metadata;
    const auto layout = md.find(std::string(kKvLayoutKey));
    PagedKv p = read_paged_layout(path_, *file_, q, layout == md.end() ? nullptr : &layout->second);
    c_.B = q.shape[0], c_.Hq = q.shape[1], c_.Nq = q.shape[2], c_.Dk = q.shape[3];
    c_.Hkv = p.Hkv, c_.Nk = p.Nk(), c_.Dv = p.Dv;
    const std::vector<std::int64_t> lk = lengths(*file_->find("seqlens_k"), p.Nk(), "Nk");
    gathered_ = gather_paged(path_, *file_, p, lk);
    decode({{&q, &c_.q}, {&gathered_.k, &c_.k}, {&gathered_.v, &c_.v}}, true);
    gathered_ = {};
    c_.paged = std::move(p);
  }

  // K/V in a stored form of CONTRACT section 9, contiguous or paged: the real k and v computed
  // from their elements and scales (quantized_kv.cpp), their non-finite elements recorded for
  // the unused-position rules as those of any input.
  void stored_kv_inputs(const RawTensor& q) {
    const KvForm form = read_kv_form(path_, *file_, q);
    c_.B = q.shape[0], c_.Hq = q.shape[1], c_.Nq = q.shape[2], c_.Dk = q.shape[3];
    decode({{&q, &c_.q}}, true);
    if (is_paged_file(*file_)) {
      const auto& md = file_->metadata;
      const auto layout = md.find(std::string(kKvLayoutKey));
      PagedKv p = read_paged_layout(path_, *file_, q, layout == md.end() ? nullptr : &layout->second, &form);
      c_.Hkv = p.Hkv, c_.Nk = p.Nk(), c_.Dv = p.Dv;
      const std::vector<std::int64_t> lk = lengths(*file_->find("seqlens_k"), p.Nk(), "Nk");
      check_block_table(path_, p, lk);
      dequantize_kv(path_, *file_, form, q, &p, &lk, {&c_.k, &c_.v});
      c_.paged = std::move(p);
    } else {
      dequantize_kv(path_, *file_, form, q, nullptr, nullptr, {&c_.k, &c_.v});
      c_.Hkv = c_.k.shape[1], c_.Nk = c_.k.shape[2], c_.Dv = c_.v.shape[3];
    }
    for (auto [name, t] : {std::pair{"k", &c_.k}, std::pair{"v", &c_.v}})
      for (std::size_t e = 0; e < t->values.size(); ++e)
        if (!std::isfinite(t->values[e])) unchecked_[name].push_back(e);
    c_.kv_form = form;
  }

  void mha_inputs() {
    const RawTensor& x_q = input("x_q", 3, "[B,Nq,D]", kBatchAndRows >> 1 | 1);
    const RawTensor& x_kv = input("x_kv", 3, "[B,Nk,D]", kBatchAndRows >> 1 | 1);
    const RawTensor& w_q = input("w_q", 3, "[H,D,Dk]");
    const RawTensor& w_k = input("w_k", 3, "[H,D,Dk]");
    const RawTensor& w_v = input("w_v", 3, "[H,D,Dv]");
    const RawTensor& w_o = input("w_o", 2, "[H*Dv,Dout]");
    expect_same({{x_kv, 0, "B", x_q, 0}, {x_kv, 2, "D", x_q, 2}, {w_q, 1, "D", x_q, 2},
                 {w_k, 0, "H", w_q, 0}, {w_k, 1, "D", x_q, 2}, {w_k, 2, "Dk", w_q, 2},
                 {w_v, 0, "H", w_q, 0}, {w_v, 1, "D", x_q, 2}});
    const std::int64_t h = w_q.shape[0], dv = w_v.shape[2];
    if (w_o.shape[0] != h * dv)  // h * dv <= numel of w_v: no overflow
      fail("w_o", "dimension 0 is " + std::to_string(w_o.shape[0]) +
                      " but H*Dv = " + std::to_string(h) + "*" + std::to_string(dv) + " = " +
                      std::to_string(h * dv));
    c_.B = x_q.shape[0], c_.Nq = x_q.shape[1], c_.D = x_q.shape[2], c_.Nk = x_kv.shape[1];
    c_.Hq = c_.Hkv = h, c_.Dk = w_q.shape[2], c_.Dv = dv, c_.Dout = w_o.shape[1];
    decode({{&x_q, &c_.x_q}, {&x_kv, &c_.x_kv}, {&w_q, &c_.w_q}, {&w_k, &c_.w_k},
            {&w_v, &c_.w_v}, {&w_o, &c_.w_o}}, false);
    c_.self_attention = c_.x_kv.shape == c_.x_q.shape && c_.x_kv.values == c_.x_q.values;
  }

  // FP8 descales [B, Hkv], F32, finite and > 0: the real q[b, h] is the stored value times
  // q_descale[b, g(h)], likewise k[b, g] and v[b, g] (FlashAttention 3's convention). An FP8
  // value has at most 4 significant bits and an F32 24, so each product is exact in a double
  // (within its exponent range too): the case holds the real inputs, and nothing else changes.
  void apply_descales(const SafeTensorsFile& file) {
    struct Target {
      const char* name;
      FloatTensor* t;
      bool per_query_head;
    };
    for (const Target& d : {Target{"q_descale", &c_.q, true}, Target{"k_descale", &c_.k, false},
                            Target{"v_descale", &c_.v, false}}) {
      const RawTensor* t = file.find(d.name);
      if (!t) continue;
      const bool view = c_.kv_form && c_.kv_form->v_from_k;  // v is k's view: k_descale scales it
      if (view && d.t == &c_.v) fail(d.name, "given with attn.v_from_k (v is a view of k and takes k_descale)");
      if (!is_fp8(c_.input_dtype))
        fail(d.name, "is for FP8 inputs only (F8_E4M3, F8_E5M2), but the inputs are " +
                         std::string(dtype_name(c_.input_dtype)));
      expect_dtype(*t, DType::F32);
      expect_shape(*t, {c_.B, c_.Hkv}, "[B,Hkv]");
      const FloatTensor s = floats(*t, false);
      for (std::size_t e = 0; e < s.values.size(); ++e)
        if (!(s.values[e] > 0))
          fail(d.name, "element " + std::to_string(e) + " is " + decimal(s.values[e]) +
                           "; descales must be > 0");
      const std::int64_t heads = d.per_query_head ? c_.Hq : c_.Hkv;
      const auto row = static_cast<std::int64_t>(d.t->values.size()) / (c_.B * heads);
      for (std::int64_t b = 0; b < c_.B; ++b)
        for (std::int64_t h = 0; h < heads; ++h) {
          const double f = s.values[static_cast<std::size_t>(
              b * c_.Hkv + (d.per_query_head ? c_.kv_head(h) : h))];
          double* x = d.t->values.data() + (b * heads + h) * row;
          for (std::int64_t e = 0; e < row; ++e) x[e] *= f;  // exact (above)
          if (view && d.t == &c_.k)
            for (std::int64_t e = 0; e < c_.Nk * c_.Dv; ++e)
              c_.v.values[static_cast<std::size_t>((b * heads + h) * c_.Nk * c_.Dv + e)] *= f;
        }
    }
  }

  // o_scale: with an FP8 out (and only then), an F32 scalar, finite and > 0.
  void output_scale(const SafeTensorsFile& file) {
    const RawTensor* t = file.find("o_scale");
    const bool fp8_out = is_fp8(c_.dtype_of("out"));
    if (!t) {
      if (fp8_out)
        fail("o_scale", "missing (required with attn.output_dtype " + std::string(dtype_name(c_.dtype_of("out"))) + ")");
      return;
    }
    if (!fp8_out)
      fail("o_scale", "given, but out's dtype is " + std::string(dtype_name(c_.dtype_of("out"))) +
                          " (o_scale is for attn.output_dtype F8_E4M3 or F8_E5M2)");
    expect_dtype(*t, DType::F32);
    if (!t->shape.empty()) fail("o_scale", "shape " + shape_string(t->shape) + " is not [] (a scalar)");
    const double s = decode_float(DType::F32, t->data.data());
    if (!std::isfinite(s) || !(s > 0))
      fail("o_scale", "element 0 is " + decimal(s) + "; o_scale must be finite and > 0");
    c_.o_scale = s;
  }

  // Non-finite values at unused positions (CONTRACT section 1, kind sdpa): a q row of a padding
  // query, a bias entry all of whose rows are padding, a k or v row of a key that no query
  // (other than padding) of any head reading its kv head attends. Any other is refused. The
  // case then holds 0 in their place, so that no evaluation ever reads them, and the padding
  // rows that would read one are masked out in its mask (zeros, row.valid false).
  void unused_positions() {
    const Case& c = c_;
    const auto& qs = unchecked_["q"];
    const auto& ks = unchecked_["k"];
    const auto& vs = unchecked_["v"];
    const auto& bs = unchecked_["bias"];
    const auto at = [](std::size_t e) { return "element " + std::to_string(e) + " is "; };
    const std::string rule = " (non-finite values are allowed only at unused positions)";
    // [B, Hq, Nq]: padding rows that would read a non-finite value.
    std::vector<unsigned char> poisoned(static_cast<std::size_t>(c.B * c.Hq * c.Nq), 0);
    auto row = [&](std::int64_t b, std::int64_t h, std::int64_t i) -> unsigned char& {
      return poisoned[static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i)];
    };
    for (std::size_t e : qs) {
      const auto r = static_cast<std::int64_t>(e) / c.Dk;  // the row (b * Hq + h) * Nq + i
      const std::int64_t b = r / (c.Hq * c.Nq), h = r / c.Nq % c.Hq, i = r % c.Nq;
      if (c.query_valid(b, i))
        fail("q", at(e) + non_finite_name(c.q.values[e]) + ", in query " + std::to_string(i) +
                      " of b=" + std::to_string(b) + ", h=" + std::to_string(h) +
                      ", which is not padding" + rule);
      row(b, h, i) = 1;
    }
    if (!bs.empty()) {
      const Shape& shape = c.bias->shape;
      const std::size_t r = shape.size();
      // The extent of bias dimension `full_axis` of [B,Hq,Nq,Nk] (1: broadcast, or absent).
      auto extent = [&](std::size_t full_axis) {
        return full_axis + r >= 4 ? shape[full_axis + r - 4] : std::int64_t{1};
      };
      for (std::size_t e : bs) {
        std::array<std::int64_t, 4> idx{};  // e unravelled over [B,Hq,Nq,Nk] extents
        for (std::size_t a = 4, rest = e; a-- > 0;) {
          const auto n = static_cast<std::size_t>(extent(a));
          idx[a] = static_cast<std::int64_t>(rest % n);
          rest /= n;
        }
        const bool all_b = extent(0) == 1 && c.B > 1, all_i = extent(2) == 1 && c.Nq > 1;
        for (std::int64_t b = all_b ? 0 : idx[0]; b <= (all_b ? c.B - 1 : idx[0]); ++b)
          for (std::int64_t i = all_i ? 0 : idx[2]; i <= (all_i ? c.Nq - 1 : idx[2]); ++i) {
            if (c.query_valid(b, i))
              fail("bias", at(e) + non_finite_name(c.bias->values[e]) + ", on query " +
                               std::to_string(i) + " of b=" + std::to_string(b) +
                               ", which is not padding (only -infinity is allowed, other than on "
                               "padding rows)");
            const bool all_h = extent(1) == 1;
            for (std::int64_t h = all_h ? 0 : idx[1]; h <= (all_h ? c.Hq - 1 : idx[1]); ++h)
              row(b, h, i) = 1;
          }
      }
      for (std::size_t e : bs) c_.bias->values[e] = 0;  // its rows are masked out below
    }
    if (!ks.empty() || !vs.empty()) {
      // [B, Hkv, Nk]: key rows holding a non-finite value
      std::vector<unsigned char> bad(static_cast<std::size_t>(c.B * c.Hkv * c.Nk), 0);
      for (std::size_t e : ks) bad[e / static_cast<std::size_t>(c.Dk)] = 1;
      for (std::size_t e : vs) bad[e / static_cast<std::size_t>(c.Dv)] = 1;
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t h = 0; h < c.Hq; ++h)
          for (std::int64_t i = 0; i < c.Nq; ++i) {
            const Case::KeyRange kr = c.key_range(b, i);
            for (std::int64_t j = kr.first; j <= kr.last; ++j) {
              const auto key = static_cast<std::size_t>((b * c.Hkv + c.kv_head(h)) * c.Nk + j);
              if (!bad[key] || !c.allowed(b, h, i, j)) continue;
              if (c.query_valid(b, i)) {
                const bool in_k = std::any_of(ks.begin(), ks.end(), [&](std::size_t e) {
                  return e / static_cast<std::size_t>(c.Dk) == key;
                });
                const auto& list = in_k ? ks : vs;
                const std::size_t width = static_cast<std::size_t>(in_k ? c.Dk : c.Dv);
                const std::size_t e =
                    *std::find_if(list.begin(), list.end(), [&](std::size_t x) { return x / width == key; });
                const double x = (in_k ? c.k : c.v).values[e];
                std::string field = in_k ? "k" : "v", where = at(e);
                if (c.paged) {  // named in the cache the value came from
                  const std::int64_t page = c.paged->page(b, j), slot = j % c.paged->page_size;
                  field += "_cache";
                  where = "element " +
                          std::to_string(c.paged->cache_index(page, slot, c.kv_head(h), static_cast<std::int64_t>(width)) +
                                         static_cast<std::int64_t>(e % width)) +
                          " (page " + std::to_string(page) + ", slot " + std::to_string(slot) + ") is ";
                }
                fail(field,
                     where + non_finite_name(x) + ", in key " + std::to_string(j) + " of b=" +
                         std::to_string(b) + ", kv head " + std::to_string(c.kv_head(h)) +
                         ", which query " + std::to_string(i) + " of head " + std::to_string(h) +
                         " attends" + rule);
              }
              row(b, h, i) = 1;
            }
          }
    }
    for (std::size_t e : qs) c_.q.values[e] = 0;
    for (std::size_t e : ks) c_.k.values[e] = 0;
    for (std::size_t e : vs) c_.v.values[e] = 0;
    if (std::none_of(poisoned.begin(), poisoned.end(), [](unsigned char p) { return p != 0; }))
      return;
    // The mask in full, the poisoned padding rows masked out.
    BoolTensor m{{c.B, c.Hq, c.Nq, c.Nk}, {}};
    m.values.resize(static_cast<std::size_t>(c.B * c.Hq * c.Nq * c.Nk));
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i)
          for (std::int64_t j = 0; j < c.Nk; ++j)
            m.values[static_cast<std::size_t>(((b * c.Hq + h) * c.Nq + i) * c.Nk + j)] =
                !row(b, h, i) && c.mask_at(b, h, i, j);
    c_.mask = std::move(m);
  }

  // Kind merge (CONTRACT section 8): o_partial [S,B,H,Nq,Dv] (F32, F16, BF16), lse_partial
  // [S,B,H,Nq] (F32, F64), sinks [H] (F32, F64). lse_partial is finite or -inf (+inf too with
  // attn.lse_posinf empty, read as -inf); o_partial is finite where its lse_partial is not -inf,
  // and holds 0 in the case where it is (anything in the file).
  void merge_inputs(const SafeTensorsFile& file) {
    for (const auto& t : file.tensors) {
      consistent(t);
      if (t.name != "o_partial" && t.name != "lse_partial" && t.name != "sinks")
        fail(printable(t.name), "unknown tensor (expected o_partial, lse_partial, and optionally sinks, for attn.kind merge)");
    }
    file_ = &file;
    const RawTensor& o = required("o_partial");
    const RawTensor& l = required("lse_partial");
    if (o.dtype != DType::F32 && o.dtype != DType::F16 && o.dtype != DType::BF16)
      fail("o_partial", "dtype " + std::string(dtype_name(o.dtype)) + " is not F32, F16 or BF16");
    if (l.dtype != DType::F32 && l.dtype != DType::F64)
      fail("lse_partial", "dtype " + std::string(dtype_name(l.dtype)) + " is not F32 or F64");
    expect_rank(o, 5, 5, "[S,B,H,Nq,Dv]");
    expect_shape(l, Shape(o.shape.begin(), o.shape.end() - 1), "[S,B,H,Nq] (from o_partial)");
    c_.input_dtype = o.dtype;
    c_.output_dtype = output_dtype_.value_or(o.dtype);
    const std::int64_t S = o.shape[0];
    c_.B = o.shape[1], c_.Hq = c_.Hkv = o.shape[2], c_.Nq = o.shape[3], c_.Dv = o.shape[4];
    c_.Nk = S, c_.Dk = 1;
    c_.lse_partial = floats(l, true, true);
    for (std::size_t e : unchecked_["lse_partial"]) {
      double& x = c_.lse_partial.values[e];
      if (std::isnan(x) || !c_.lse_posinf_empty)
        fail("lse_partial", "element " + std::to_string(e) + " is " + non_finite_name(x) +
                                " (only -infinity is allowed; attn.lse_posinf empty reads +infinity as -infinity)");
      x = -std::numeric_limits<double>::infinity();
    }
    c_.o_partial = floats(o, false, true);
    const auto row = static_cast<std::size_t>(c_.Dv);
    for (std::size_t e : unchecked_["o_partial"]) {
      const std::size_t r = e / row;  // ((s * B + b) * H + h) * Nq + i
      if (c_.lse_partial.values[r] != -std::numeric_limits<double>::infinity())
        fail("o_partial", "element " + std::to_string(e) + " is " + non_finite_name(c_.o_partial.values[e]) +
                              ", in a split whose lse_partial (element " + std::to_string(r) +
                              ") is not -infinity (non-finite values are allowed only in empty splits)");
    }
    for (std::size_t r = 0; r < c_.lse_partial.values.size(); ++r)
      if (c_.lse_partial.values[r] == -std::numeric_limits<double>::infinity())
        std::fill_n(c_.o_partial.values.begin() + static_cast<std::ptrdiff_t>(r * row), row, 0.0);
    if (const RawTensor* t = file.find("sinks")) {
      if (t->dtype != DType::F64 && t->dtype != DType::F32)
        fail("sinks", "dtype " + std::string(dtype_name(t->dtype)) + " is not F32 or F64");
      expect_shape(*t, {c_.Hq}, "[H]");
      c_.sinks = floats(*t, false);
    }
  }

  const std::string& path_;
  Case& c_;
  std::map<std::string, std::vector<std::size_t>> unchecked_;  // non-finite elements by tensor
  Gathered gathered_;  // a paged case's k and v while they are decoded
  const SafeTensorsFile* file_ = nullptr;
  std::string first_input_;
  std::optional<DType> output_dtype_;
};

// Flat index into a row-major tensor of `shape`, broadcast (right-aligned) to [B,Hq,Nq,Nk].
std::size_t broadcast_index(const Shape& shape, const std::array<std::int64_t, 4>& index) {
  const std::size_t r = shape.size();
  std::int64_t flat = 0;
  for (std::size_t a = 0; a < r; ++a)
    flat = flat * shape[a] + (shape[a] == 1 ? 0 : index[4 - r + a]);
  return static_cast<std::size_t>(flat);
}

}  // namespace

namespace {

constexpr std::pair<Kind, std::string_view> kKindNames[] = {
    {Kind::Sdpa, "sdpa"}, {Kind::Mha, "mha"}, {Kind::Merge, "merge"}};
constexpr std::pair<Causal, std::string_view> kCausalNames[] = {
    {Causal::None, "none"}, {Causal::TopLeft, "top_left"}, {Causal::BottomRight, "bottom_right"}};
constexpr std::pair<MaskedRows, std::string_view> kMaskedRowsNames[] = {
    {MaskedRows::Error, "error"}, {MaskedRows::Zero, "zero"}};

// Every golden tensor name the reference may write (CONTRACT section 3).
constexpr std::string_view kGoldenNames[] = {
    "out",      "out.ref",     "out.ref_lo", "out.bound",  "row.valid", "weights",     "weights.ref",
    "lse",      "lse.ref",     "scores",     "scores.ref", "dq",        "dq.ref",      "dq.bound",
    "dk",       "dk.ref",      "dk.bound",   "dv",         "dv.ref",    "dv.bound",    "dbias",
    "dbias.ref", "dbias.bound", "dsinks", "dsinks.ref", "dsinks.bound", "dx_q", "dx_q.ref", "dx_q.bound",
    "dx_kv", "dx_kv.ref", "dx_kv.bound", "dw_q", "dw_q.ref", "dw_q.bound", "dw_k", "dw_k.ref", "dw_k.bound",
    "dw_v", "dw_v.ref", "dw_v.bound", "dw_o", "dw_o.ref", "dw_o.bound",
    "out_partial", "out_partial.ref", "out_partial.ref_lo", "out_partial.bound", "lse_partial.ref", "amax",
    "model.rows", "model.out", "model.p_bias"};
// lse_partial: golden in kind sdpa, an input of kind merge (case_from_file drops it by kind).

}  // namespace

std::string_view kind_name(Kind k) { return table_name(kKindNames, k); }
std::optional<Kind> kind_from_name(std::string_view s) { return table_from_name(kKindNames, s); }
std::string_view causal_name(Causal c) { return table_name(kCausalNames, c); }
std::optional<Causal> causal_from_name(std::string_view s) { return table_from_name(kCausalNames, s); }
std::string_view masked_rows_name(MaskedRows m) { return table_name(kMaskedRowsNames, m); }
std::optional<MaskedRows> masked_rows_from_name(std::string_view s) {
  return table_from_name(kMaskedRowsNames, s);
}

bool is_golden_tensor_name(const std::string& name) {
  static const std::set<std::string_view, std::less<>> golden(std::begin(kGoldenNames),
                                                              std::end(kGoldenNames));
  if (golden.count(name)) return true;
  for (std::string_view suffix : {".undecided", ".alt"}) {
    const std::string_view n = name;
    if (n.size() > suffix.size() && n.substr(n.size() - suffix.size()) == suffix &&
        (golden.count(n.substr(0, n.size() - suffix.size())) ||
         n.substr(0, n.size() - suffix.size()) == "lse_partial"))
      return true;
  }
  return false;
}

Case case_from_file(const std::string& path, SafeTensorsFile file) {
  // lse_partial is an input of kind merge, a golden tensor of the others.
  const auto kind = file.metadata.find("attn.kind");
  const bool merge = kind != file.metadata.end() && kind->second == "merge";
  std::erase_if(file.tensors, [merge](const RawTensor& t) {
    return is_golden_tensor_name(t.name) || (!merge && t.name == "lse_partial");
  });
  for (auto key : kReferenceKeys) file.metadata.erase(std::string(key));
  Case c;
  c.path = path;
  CaseReader reader(path, c);
  reader.metadata(file.metadata);
  reader.tensors(file);
  c.file = std::move(file);
  return c;
}

Case read_case(const std::string& path) { return case_from_file(path, read_safetensors(path)); }

std::string shape_string(const std::vector<std::int64_t>& shape) {
  // Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict on "," + std::string&&
  // (GCC bug 105329).
  std::string s = "[";
  for (std::size_t a = 0; a < shape.size(); ++a) {
    if (a) s += ',';
    s += std::to_string(shape[a]);
  }
  return s + "]";
}

bool Case::mask_at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
  if (!mask) return true;
  return mask->values[broadcast_index(mask->shape, {b, h, i, j})] != 0;
}

double Case::bias_at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
  if (!bias) return 0;
  return bias->values[broadcast_index(bias->shape, {b, h, i, j})];
}

std::size_t Case::bias_index(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
  return broadcast_index(bias->shape, {b, h, i, j});
}

bool Case::kept(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
  if (!dropout) return true;
  return dropout->keep.values[broadcast_index(dropout->keep.shape, {b, h, i, j})] != 0;
}

bool Case::query_valid(std::int64_t b, std::int64_t i) const {
  if (i >= query_length(b)) return false;
  if (!query_mask) return true;
  return query_mask->values[static_cast<std::size_t>(b * Nq + i)] != 0;
}

bool Case::position_allowed(std::int64_t b, std::int64_t i, std::int64_t j) const {
  if (j >= key_length(b) || j < key_begin || j >= key_end) return false;
  // The window follows the causal alignment.
  const std::int64_t d = j - aligned_position(b, i);  // |d| < Nq + Nk: no overflow
  if (causal != Causal::None && d > 0) return false;
  if (window && (d < -window_left || d > window_right)) return false;
  return true;
}

Case::KeyRange Case::key_range(std::int64_t b, std::int64_t i) const {
  const std::int64_t a = aligned_position(b, i);
  KeyRange r{key_begin, std::min(key_length(b), key_end) - 1};
  if (causal != Causal::None) r.last = std::min(r.last, a);
  if (window) {
    // a - L and a + R stay far from overflow: L, R have at most 18 digits, |a| < Nq + Nk.
    r.first = std::max(r.first, a - window_left);
    r.last = std::min(r.last, a + window_right);
  }
  return r;
}

std::optional<RowIndex> Case::first_refused_row() const {
  if (masked_rows != MaskedRows::Error || sinks) return std::nullopt;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < Nq; ++i)
        if (query_valid(b, i) && !row_has_key(b, h, i)) return RowIndex{b, h, i};
  return std::nullopt;
}

std::vector<std::int64_t> Case::out_shape() const {
  return kind == Kind::Mha ? std::vector<std::int64_t>{B, Nq, Dout}
                           : std::vector<std::int64_t>{B, Hq, Nq, Dv};
}

std::vector<GoldenSpec> Case::golden_tensors() const {
  const std::vector<std::int64_t> out = out_shape(), rows = row_shape(), w{B, Hq, Nq, Nk};
  std::vector<GoldenSpec> g = {{"out", dtype_of("out"), out}, {"out.ref", DType::F64, out}};
  if (dtype_of("out") == DType::F64) g.push_back({"out.ref_lo", DType::F64, out});
  g.push_back({"out.bound", DType::F64, out});
  if (want_amax) g.push_back({"amax", DType::F32, {}});
  g.push_back({"row.valid", DType::BOOL, rows});
  if (want_weights) {
    g.push_back({"weights", dtype_of("weights"), w});
    g.push_back({"weights.ref", DType::F64, w});
  }
  if (want_lse) {
    g.push_back({"lse", dtype_of("lse"), rows});
    g.push_back({"lse.ref", DType::F64, rows});
  }
  if (want_scores) {
    g.push_back({"scores", dtype_of("scores"), w});
    g.push_back({"scores.ref", DType::F64, w});
  }
  // Gradients (CONTRACT section 7): G, G.ref and G.bound, in the shape of the input.
  auto gradient = [&](bool want, const char* name, std::vector<std::int64_t> shape) {
    if (!want) return;
    g.push_back({name, dtype_of(name), shape});
    g.push_back({std::string(name) + ".ref", DType::F64, shape});
    g.push_back({std::string(name) + ".bound", DType::F64, shape});
  };
  gradient(want_dq, "dq", {B, Hq, Nq, Dk});
  gradient(want_dk, "dk", {B, Hkv, Nk, Dk});
  gradient(want_dv, "dv", {B, Hkv, Nk, Dv});
  gradient(want_dx_q, "dx_q", {B, Nq, D});
  gradient(want_dx_kv, "dx_kv", {B, Nk, D});
  gradient(want_dw_q, "dw_q", {Hq, D, Dk});
  gradient(want_dw_k, "dw_k", {Hq, D, Dk});
  gradient(want_dw_v, "dw_v", {Hq, D, Dv});
  gradient(want_dw_o, "dw_o", {Hq * Dv, Dout});
  gradient(want_dbias, "dbias", bias ? bias->shape : std::vector<std::int64_t>{});
  gradient(want_dsinks, "dsinks", {Hq});
  // Split-KV partial states (CONTRACT section 8), last: evaluated after the whole case. Both
  // come when either is asked (a pair, as out comes with lse): the gate judges a split as a case.
  const std::vector<std::int64_t> po = partial_out_shape(), pr = partial_row_shape();
  if (wants_partials()) {
    g.push_back({"out_partial", dtype_of("out_partial"), po});
    g.push_back({"out_partial.ref", DType::F64, po});
    if (dtype_of("out_partial") == DType::F64) g.push_back({"out_partial.ref_lo", DType::F64, po});
    g.push_back({"out_partial.bound", DType::F64, po});
    g.push_back({"lse_partial", dtype_of("lse_partial"), pr});
    g.push_back({"lse_partial.ref", DType::F64, pr});
  }
  return g;
}

}  // namespace attnoracle
