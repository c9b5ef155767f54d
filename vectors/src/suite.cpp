// Suite specs: parsing with JSON paths in every message, and expansion into cases.
#include "attnoracle/vectors/suite.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/limits.hpp"
#include "prng.hpp"

namespace attnoracle::vectors {
namespace {

using nlohmann::json;

constexpr std::size_t kMaxCases = 100000;

// The options of a family, in expansion order: the first varies slowest.
constexpr std::array<std::string_view, 39> kOptions = {
    "kind",       "dtype",      "output_dtype", "shape",   "causal",     "window",
    "softcap",    "scale",      "mask",         "bias",    "bias_dtype", "bias_fill",
    "query_mask", "seqlens",    "seqlens_dtype", "poison", "masked_rows", "outputs",
    "self",       "params",     "descales",     "sinks",   "sinks_dtype", "dout",
    "output_dtypes", "page_size", "kv_layout", "pages", "kv_split_size", "lse_partial",
    "kv_format",  "kv_scale",   "kv_scale_binades", "v_from_k", "o_scale",
    "rotary",     "rotary_dim", "rotary_round", "dropout"};

std::string brief(const json& j) { return printable(j.dump()); }

bool name_ok(const std::string& s) {
  if (s.empty() || s.size() > 100) return false;
  for (unsigned char ch : s)
    if (!std::isalnum(ch) && ch != '_' && ch != '-' && ch != '.') return false;
  return s[0] != '.';
}

// An option value and where it stands in the spec.
struct Located {
  const json* value;
  std::string path;
};

class SpecReader {
 public:
  explicit SpecReader(const std::string& file) : file_(file) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw InputError(file_, path, what);
  }

  json parse(std::string_view text) const {
    if (limits::json_depth(text) > limits::kJsonDepth)
      throw InputError(file_, "", "invalid JSON: nested deeper than " +
                                      std::to_string(limits::kJsonDepth) + " levels");
    struct Frame {
      bool array;
      std::string key;
      long index = -1;
      std::set<std::string> keys;
    };
    std::vector<Frame> frames;
    std::string duplicate_path;
    auto path_of = [&](std::size_t upto) {
      std::string p;
      for (std::size_t f = 0; f < upto && f < frames.size(); ++f) {
        if (frames[f].array)
          p += "[" + std::to_string(frames[f].index) + "]";
        else if (!frames[f].key.empty())
          p += (p.empty() ? "" : ".") + frames[f].key;
      }
      return p;
    };
    auto element = [&] {
      if (!frames.empty() && frames.back().array) ++frames.back().index;
    };
    auto callback = [&](int, json::parse_event_t event, json& parsed) {
      switch (event) {
        case json::parse_event_t::object_start:
          element();
          frames.push_back({false, "", -1, {}});
          break;
        case json::parse_event_t::array_start:
          element();
          frames.push_back({true, "", -1, {}});
          break;
        case json::parse_event_t::object_end:
        case json::parse_event_t::array_end:
          frames.pop_back();
          break;
        case json::parse_event_t::key: {
          Frame& f = frames.back();
          f.key = parsed.get<std::string>();
          if (!f.keys.insert(f.key).second && duplicate_path.empty())
            duplicate_path = path_of(frames.size());
          break;
        }
        case json::parse_event_t::value:
          element();
          break;
      }
      return true;
    };
    json j;
    try {
      j = json::parse(text.begin(), text.end(), callback);
    } catch (const json::exception& e) {  // parse_error; out_of_range for a number past double
      std::string what = e.what();
      if (auto pos = what.find("] "); pos != std::string::npos) what.erase(0, pos + 2);
      std::string where = "JSON";
      if (auto at = what.find(" at line "); at != std::string::npos) {
        const auto colon = what.find(": ", at);
        where = what.substr(at + 4, colon - at - 4);
        what = what.substr(0, at) + what.substr(colon);
      }
      fail(where, "invalid JSON: " + printable(what));
    }
    if (!duplicate_path.empty()) fail(duplicate_path, "key appears twice in its object");
    return j;
  }

  // Keys of an object must be among `known`.
  void keys(const json& obj, const std::string& path, std::initializer_list<std::string_view> known,
            std::initializer_list<std::string_view> required) const {
    if (!obj.is_object())
      fail(path.empty() ? "$" : path, "must be a JSON object, not " + type(obj));
    for (const auto& [k, v] : obj.items())
      if (std::find(known.begin(), known.end(), k) == known.end()) {
        std::string list;
        for (auto n : known) list += (list.empty() ? "" : ", ") + std::string(n);
        fail(join(path, printable(k)), "unknown key (expected one of " + list + ")");
      }
    for (auto r : required)
      if (!obj.contains(std::string(r))) fail(join(path, std::string(r)), "missing");
  }

  static std::string join(const std::string& path, const std::string& key) {
    return path.empty() ? key : path + "." + key;
  }
  static std::string type(const json& j) { return std::string("a JSON ") + j.type_name(); }

  std::string string(const json& j, const std::string& path) const {
    if (!j.is_string()) fail(path, "must be a string, not " + type(j));
    return j.get<std::string>();
  }
  std::int64_t integer(const json& j, const std::string& path, std::int64_t lo,
                       std::int64_t hi) const {
    if (!j.is_number_integer()) fail(path, "must be an integer, not " + brief(j));
    // JSON's non-negative integers are unsigned: both bounds apply to them too (a size of 0
    // would divide by zero); the cast is exact once u <= hi.
    const bool out = j.is_number_unsigned()
                         ? j.get<std::uint64_t>() > static_cast<std::uint64_t>(hi) ||
                               static_cast<std::int64_t>(j.get<std::uint64_t>()) < lo
                         : j.get<std::int64_t>() < lo || j.get<std::int64_t>() > hi;
    if (out)
      fail(path, "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", not " +
                     brief(j));
    return j.get<std::int64_t>();
  }
  bool boolean(const json& j, const std::string& path) const {
    if (!j.is_boolean()) fail(path, "must be true or false, not " + brief(j));
    return j.get<bool>();
  }
  std::string choice(const json& j, const std::string& path,
                     std::initializer_list<std::string_view> allowed) const {
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    if (!j.is_string() ||
        std::find(allowed.begin(), allowed.end(), j.get<std::string>()) == allowed.end())
      fail(path, brief(j) + " is not one of " + list);
    return j.get<std::string>();
  }
  // An enum given by its metadata name; `values` lists the choices for the message.
  template <class E>
  E named(const json& j, const std::string& path, std::optional<E> (*from)(std::string_view),
          std::string_view (*name)(E), std::initializer_list<E> values) const {
    if (j.is_string())
      if (const std::optional<E> e = from(j.get<std::string>())) return *e;
    std::string list;
    for (E e : values) list += (list.empty() ? "" : ", ") + std::string(name(e));
    fail(path, brief(j) + " is not one of " + list);
  }
  DType dtype(const json& j, const std::string& path) const {
    const std::string s = choice(j, path, {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"});
    return *dtype_from_name(s);
  }
  // A number written as JSON number or as text, kept as text (attn.scale, attn.softcap).
  std::string number_text(const json& j, const std::string& path) const {
    if (j.is_number()) return j.dump();
    if (j.is_string()) return j.get<std::string>();
    fail(path, "must be a number or a string holding one, not " + brief(j));
  }

  // Applies option `key` with value `v` (found at `path`) to p.
  void apply(ProblemSpec& p, std::string_view key, const json& v, const std::string& path,
             std::vector<std::int64_t>& shape, std::string& shape_path) const {
    if (key == "kind") {
      p.kind = named(v, path, kind_from_name, kind_name, {Kind::Sdpa, Kind::Mha, Kind::Merge});
    } else if (key == "dtype") {
      p.dtype = dtype(v, path);
    } else if (key == "output_dtype") {
      if (v.is_string() && v.get<std::string>() == "same")
        p.output_dtype.reset();
      else
        p.output_dtype = dtype(v, path);
    } else if (key == "output_dtypes") {  // "lse:F32,..."; "none": none
      const std::string s = string(v, path);
      p.output_dtypes = s == "none" ? "" : s;
    } else if (key == "shape") {
      if (!v.is_array() || v.size() < 5 || v.size() > 8 || v.size() == 6)
        fail(path, "must be [B,Hq,Hkv,Nq,Nk,Dk,Dv] (sdpa), [B,H,Nq,Nk,D,Dk,Dv,Dout] (mha) or [S,B,H,Nq,Dv] (merge), not " +
                       brief(v));
      shape.clear();
      for (std::size_t a = 0; a < v.size(); ++a)
        shape.push_back(integer(v[a], path + "[" + std::to_string(a) + "]", 1, 1 << 24));
      shape_path = path;
    } else if (key == "causal") {
      p.causal = named(v, path, causal_from_name, causal_name,
                       {Causal::None, Causal::TopLeft, Causal::BottomRight});
    } else if (key == "window") {
      if (v.is_string() && v.get<std::string>() == "none") {
        p.window.reset();
      } else {
        if (!v.is_array() || v.size() != 2)
          fail(path, "must be \"none\" or [L, R], not " + brief(v));
        p.window = std::make_pair(integer(v[0], path + "[0]", 0, 1 << 24),
                                  integer(v[1], path + "[1]", 0, 1 << 24));
      }
    } else if (key == "softcap") {
      const std::string t = number_text(v, path);
      p.softcap = t == "0" || t == "0.0" ? "" : t;
    } else if (key == "scale") {
      const std::string t = number_text(v, path);
      p.scale = t == "default" ? "" : t;
    } else if (key == "mask") {
      p.mask = named(v, path, mask_kind_from_name, mask_kind_name,
                     {MaskKind::None, MaskKind::KeyPadding, MaskKind::Random, MaskKind::SingleKey,
                      MaskKind::FullyMaskedRows, MaskKind::CausalMask,
                      MaskKind::KeyPaddingBroadcast, MaskKind::KeyVector, MaskKind::TailBlock});
    } else if (key == "bias") {
      p.bias = named(v, path, bias_kind_from_name, bias_kind_name,
                     {BiasKind::None, BiasKind::Alibi, BiasKind::Random, BiasKind::Fill, BiasKind::Scalar,
                      BiasKind::PerKey, BiasKind::RowOffset});
    } else if (key == "bias_dtype") {
      p.bias_dtype = dtype(v, path);
    } else if (key == "bias_fill") {
      p.bias_fill = number_text(v, path);
      if (p.bias != BiasKind::Fill)
        fail(path, "needs bias fill, not " + std::string(bias_kind_name(p.bias)));
      if (auto f = bias_fill_value(p); !f.error.empty()) fail(path, f.error);
    } else if (key == "query_mask") {
      p.query_mask = boolean(v, path);
    } else if (key == "seqlens") {
      p.seqlens = named(v, path, seqlens_kind_from_name, seqlens_kind_name,
                        {SeqlensKind::None, SeqlensKind::Varlen, SeqlensKind::Decode,
                         SeqlensKind::Chunked, SeqlensKind::Keys});
    } else if (key == "seqlens_dtype") {
      p.seqlens_dtype = *dtype_from_name(choice(v, path, {"I32", "I64"}));
    } else if (key == "poison") {
      p.poison = boolean(v, path);
    } else if (key == "descales") {
      p.descales = boolean(v, path);
    } else if (key == "masked_rows") {
      p.masked_rows = named(v, path, masked_rows_from_name, masked_rows_name,
                            {MaskedRows::Error, MaskedRows::Zero});
    } else if (key == "outputs") {
      std::vector<std::string> names;
      if (v.is_string()) {
        std::string s = v.get<std::string>();
        for (std::size_t start = 0;;) {
          const auto comma = s.find(',', start);
          names.push_back(s.substr(start, comma - start));
          if (comma == std::string::npos) break;
          start = comma + 1;
        }
      } else if (v.is_array()) {
        for (std::size_t a = 0; a < v.size(); ++a)
          names.push_back(string(v[a], path + "[" + std::to_string(a) + "]"));
      } else {
        fail(path, "must be a comma list or an array of out, weights, lse, scores, dq, dk, dv, dbias, dsinks, "
                   "dx_q, dx_kv, dw_q, dw_k, dw_v, dw_o, out_partial, lse_partial, amax, not " + brief(v));
      }
      p.want_weights = p.want_lse = p.want_scores = false;
      p.want_dq = p.want_dk = p.want_dv = p.want_dbias = p.want_dsinks = false;
      p.want_out_partial = p.want_lse_partial = p.want_amax = false;
      p.want_mha = {};
      for (const auto& n : names) {
        const auto mha = std::find_if(kMhaGradients.begin(), kMhaGradients.end(), [&](const char* g) { return n == g; });
        if (mha != kMhaGradients.end())
          p.want_mha[static_cast<std::size_t>(mha - kMhaGradients.begin())] = true;
        else if (n == "weights")
          p.want_weights = true;
        else if (n == "lse")
          p.want_lse = true;
        else if (n == "scores")
          p.want_scores = true;
        else if (n == "dq")
          p.want_dq = true;
        else if (n == "dk")
          p.want_dk = true;
        else if (n == "dv")
          p.want_dv = true;
        else if (n == "dbias")
          p.want_dbias = true;
        else if (n == "dsinks")
          p.want_dsinks = true;
        else if (n == "out_partial")
          p.want_out_partial = true;
        else if (n == "lse_partial")
          p.want_lse_partial = true;
        else if (n == "amax")
          p.want_amax = true;
        else if (n != "out")
          fail(path, "\"" + printable(n) + "\" is not one of out, weights, lse, scores, dq, dk, dv, dbias, dsinks, "
                     "dx_q, dx_kv, dw_q, dw_k, dw_v, dw_o, out_partial, lse_partial, amax");
      }
    } else if (key == "page_size") {  // 0: contiguous k and v
      p.page_size = integer(v, path, 0, 1 << 24);
    } else if (key == "kv_layout") {
      p.kv_layout_hnd = choice(v, path, {"NHD", "HND"}) == "HND";
    } else if (key == "pages") {
      const std::string c = choice(v, path, {"ordered", "shuffled", "shared"});
      p.pages = c == "ordered"    ? ProblemSpec::Pages::Ordered
                : c == "shuffled" ? ProblemSpec::Pages::Shuffled
                                  : ProblemSpec::Pages::Shared;
    } else if (key == "lse_partial") {
      p.lse_partial = choice(v, path, {"normal", "wide", "neg_inf", "pos_inf", "all_neg_inf"});
    } else if (key == "kv_format") {
      const std::string c = choice(v, path, {"none", "F8_E4M3", "F8_E5M2", "I8", "mxfp8", "nvfp4"});
      p.kv_format = c == "none" ? "" : c;
    } else if (key == "kv_scale") {
      p.kv_scale = choice(v, path, {"tensor", "head", "token"});
    } else if (key == "kv_scale_binades") {
      p.kv_scale_binades = integer(v, path, 0, 30);
    } else if (key == "v_from_k") {
      p.v_from_k = boolean(v, path);
    } else if (key == "o_scale") {
      p.o_scale = number_text(v, path);
    } else if (key == "kv_split_size") {  // 0: none
      p.kv_split_size = integer(v, path, 0, 1 << 24);
    } else if (key == "self") {
      p.self_attention = boolean(v, path);
    } else if (key == "sinks") {
      p.sinks = v.is_string() && v.get<std::string>() == "none" ? "" : number_text(v, path);
    } else if (key == "dropout") {
      p.dropout = v.is_string() && v.get<std::string>() == "none" ? "" : number_text(v, path);
    } else if (key == "sinks_dtype") {
      p.sinks_dtype = dtype(v, path);
    } else if (key == "rotary") {
      const std::string c = choice(v, path, {"none", "interleaved", "half"});
      p.rotary = c == "none" ? "" : c;
    } else if (key == "rotary_dim") {  // 0: Dk
      p.rotary_dim = integer(v, path, 0, 1 << 20);
    } else if (key == "rotary_round") {
      p.rotary_round = dtype(v, path);
    } else if (key == "dout") {
      p.dout = string(v, path);
    } else if (key == "params") {
      if (!v.is_object()) fail(path, "must be an object of generator parameters, not " + brief(v));
      p.params.clear();
      for (const auto& [name, x] : v.items()) {
        if (!x.is_number()) fail(join(path, printable(name)), "must be a number, not " + brief(x));
        p.params[name] = x.get<double>();
      }
    }
  }

  Suite suite(const json& j) const {
    keys(j, "", {"suite", "seed", "description", "families"}, {"suite", "seed", "families"});
    Suite s;
    s.name = string(j["suite"], "suite");
    if (!name_ok(s.name))
      fail("suite", "\"" + printable(s.name) + "\" is not a name of letters, digits, _ - .");
    if (!j["seed"].is_number_integer() ||
        (!j["seed"].is_number_unsigned() && j["seed"].get<std::int64_t>() < 0))
      fail("seed", "must be a non-negative integer, not " + brief(j["seed"]));
    s.seed = j["seed"].get<std::uint64_t>();
    if (j.contains("description")) string(j["description"], "description");
    const json& fams = j["families"];
    if (!fams.is_array() || fams.empty()) fail("families", "must be a non-empty array");
    std::set<std::string> names;
    for (std::size_t f = 0; f < fams.size(); ++f) {
      const std::string fp = "families[" + std::to_string(f) + "]";
      family(fams[f], fp, s, names);
    }
    return s;
  }

  void family(const json& fam, const std::string& fp, Suite& s,
              std::set<std::string>& names) const {
    keys(fam, fp, {"name", "generator", "description", "tags", "cross", "fixed", "seeds"},
         {"name", "generator"});
    const std::string name = string(fam["name"], fp + ".name");
    if (!name_ok(name))
      fail(fp + ".name", "\"" + printable(name) + "\" is not a name of letters, digits, _ - .");
    if (!names.insert(name).second) fail(fp + ".name", "family \"" + name + "\" appears twice");
    const std::string generator = string(fam["generator"], fp + ".generator");
    if (!find_generator(generator)) {
      std::string list;
      for (const auto& g : generators()) list += (list.empty() ? "" : ", ") + std::string(g.name);
      fail(fp + ".generator",
           "unknown generator \"" + printable(generator) + "\" (known: " + list + ")");
    }
    if (fam.contains("description")) string(fam["description"], fp + ".description");
    std::vector<std::string> tags;
    if (fam.contains("tags")) {
      const json& t = fam["tags"];
      if (!t.is_array()) fail(fp + ".tags", "must be an array of strings");
      for (std::size_t a = 0; a < t.size(); ++a) {
        const std::string tp = fp + ".tags[" + std::to_string(a) + "]";
        const std::string tag = string(t[a], tp);
        if (!name_ok(tag))
          fail(tp, "\"" + printable(tag) + "\" is not a name of letters, digits, _ - .");
        tags.push_back(tag);
      }
    }
    const std::int64_t seeds =
        fam.contains("seeds") ? integer(fam["seeds"], fp + ".seeds", 1, 10000) : 1;

    // Each option: the list of values it takes (one for fixed ones, none when absent).
    std::vector<std::vector<Located>> lists(kOptions.size());
    auto option_index = [&](const std::string& key, const std::string& path) {
      const auto it = std::find(kOptions.begin(), kOptions.end(), key);
      if (it == kOptions.end()) {
        std::string list;
        for (auto n : kOptions) list += (list.empty() ? "" : ", ") + std::string(n);
        fail(path, "unknown option (expected one of " + list + ")");
      }
      return static_cast<std::size_t>(it - kOptions.begin());
    };
    if (fam.contains("cross")) {
      const json& c = fam["cross"];
      if (!c.is_object()) fail(fp + ".cross", "must be an object of option lists");
      for (const auto& [key, values] : c.items()) {
        const std::string kp = fp + ".cross." + printable(key);
        const std::size_t o = option_index(key, kp);
        if (!values.is_array() || values.empty())
          fail(kp, "must be a non-empty array of values, not " + brief(values));
        for (std::size_t a = 0; a < values.size(); ++a)
          lists[o].push_back({&values[a], kp + "[" + std::to_string(a) + "]"});
      }
    }
    if (fam.contains("fixed")) {
      const json& c = fam["fixed"];
      if (!c.is_object()) fail(fp + ".fixed", "must be an object of option values");
      for (const auto& [key, value] : c.items()) {
        const std::string kp = fp + ".fixed." + printable(key);
        const std::size_t o = option_index(key, kp);
        if (!lists[o].empty()) fail(kp, "is also in cross");
        lists[o].push_back({&value, kp});
      }
    }
    std::size_t combos = 1;
    for (const auto& l : lists)
      if (!l.empty()) {
        combos *= l.size();
        if (combos > kMaxCases)
          fail(fp, "expands to more than " + std::to_string(kMaxCases) + " cases");
      }
    const std::size_t count = combos * static_cast<std::size_t>(seeds);
    if (s.cases.size() + count > kMaxCases)
      fail(fp, "the suite expands to more than " + std::to_string(kMaxCases) + " cases");
    const int width = std::max<int>(3, static_cast<int>(std::to_string(count - 1).size()));

    std::vector<std::size_t> at(lists.size(), 0);  // the odometer; the last option turns fastest
    std::size_t index = 0;
    for (std::size_t combo = 0; combo < combos; ++combo) {
      ProblemSpec p;
      p.generator = generator;
      std::vector<std::int64_t> shape;
      std::string shape_path;
      for (std::size_t o = 0; o < lists.size(); ++o)
        if (!lists[o].empty()) {
          const Located& l = lists[o][at[o]];
          apply(p, kOptions[o], *l.value, l.path, shape, shape_path);
        }
      if (!shape.empty())
        set_shape(p, shape, shape_path);
      else if (p.kind == Kind::Mha)
        p.D = p.Dout = 1;
      for (std::int64_t k = 0; k < seeds; ++k, ++index) {
        CaseSpec c;
        std::string num = std::to_string(index);
        c.id = name + "-" +
               std::string(
                   static_cast<std::size_t>(std::max<int>(0, width - static_cast<int>(num.size()))),
                   '0') +
               num;
        c.family = name;
        c.seed = case_seed(s.seed, name, index);
        c.problem = p;
        if (auto e = problem_error(p)) fail(fp, "case " + c.id + ": " + *e);
        c.tags = tags;
        for (auto& t : option_tags(p))
          if (std::find(c.tags.begin(), c.tags.end(), t) == c.tags.end()) c.tags.push_back(t);
        s.cases.push_back(std::move(c));
      }
      for (std::size_t o = lists.size(); o-- > 0;) {
        if (lists[o].empty()) continue;
        if (++at[o] < lists[o].size()) break;
        at[o] = 0;
      }
    }
  }

  void set_shape(ProblemSpec& p, const std::vector<std::int64_t>& s,
                 const std::string& path) const {
    if (p.kind == Kind::Merge) {
      if (s.size() != 5) fail(path, "kind merge needs 5 sizes [S,B,H,Nq,Dv]");
      p.Nk = s[0], p.B = s[1], p.Hq = p.Hkv = s[2], p.Nq = s[3], p.Dk = 1, p.Dv = s[4];
    } else if (p.kind == Kind::Sdpa) {
      if (s.size() != 7) fail(path, "kind sdpa needs 7 sizes [B,Hq,Hkv,Nq,Nk,Dk,Dv]");
      p.B = s[0], p.Hq = s[1], p.Hkv = s[2], p.Nq = s[3], p.Nk = s[4], p.Dk = s[5], p.Dv = s[6];
      if (p.Hq % p.Hkv != 0)
        fail(path, "Hkv " + std::to_string(p.Hkv) + " does not divide Hq " + std::to_string(p.Hq));
    } else {
      if (s.size() != 8) fail(path, "kind mha needs 8 sizes [B,H,Nq,Nk,D,Dk,Dv,Dout]");
      p.B = s[0], p.Hq = p.Hkv = s[1], p.Nq = s[2], p.Nk = s[3], p.D = s[4], p.Dk = s[5],
      p.Dv = s[6], p.Dout = s[7];
    }
  }

 private:
  const std::string& file_;
};

}  // namespace

std::uint64_t case_seed(std::uint64_t suite_seed, std::string_view family, std::uint64_t index) {
  std::uint64_t h = mix64(suite_seed, family.size());
  for (unsigned char ch : family) h = mix64(h, ch);
  return mix64(h, index);
}

std::vector<std::string> option_tags(const ProblemSpec& p) {
  auto lower = [](std::string_view s) {
    std::string out(s);
    for (auto& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return out;
  };
  std::vector<std::string> t;
  t.push_back(p.generator);
  t.push_back(lower(dtype_name(p.dtype)));
  if (is_fp8(p.dtype)) t.push_back("fp8");
  if (p.descales) t.push_back("descales");
  if (p.output_dtype && *p.output_dtype != p.dtype)
    t.push_back("out_" + lower(dtype_name(*p.output_dtype)));
  // an output in a dtype of its own: "lse_f32" for lse:F32
  for (std::size_t from = 0; !p.output_dtypes.empty() && from <= p.output_dtypes.size();) {
    const std::size_t comma = std::min(p.output_dtypes.find(',', from), p.output_dtypes.size());
    std::string entry = lower(p.output_dtypes.substr(from, comma - from));
    std::replace(entry.begin(), entry.end(), ':', '_');
    t.push_back(entry);
    from = comma + 1;
  }
  if (p.kind == Kind::Mha) t.push_back("mha");
  if (p.kind == Kind::Merge) {
    t.push_back("merge");
    t.push_back("splits_" + std::to_string(p.Nk));
    t.push_back("lse_partial_" + p.lse_partial);
    t.push_back("head_dim_" + std::to_string(p.Dv));
  }
  if (p.self_attention) t.push_back("self_attention");
  if (p.Hkv > 1 && p.Hq > p.Hkv) t.push_back("gqa");
  if (p.Hkv == 1 && p.Hq > 1 && p.kind == Kind::Sdpa) t.push_back("mqa");
  if (p.causal != Causal::None) t.push_back("causal_" + std::string(causal_name(p.causal)));
  if (p.kind != Kind::Merge) {  // a merge's Nk is its split count, its Dk 1
    if (p.Nq < p.Nk) t.push_back("nq_lt_nk");
    if (p.Nq > p.Nk) t.push_back("nq_gt_nk");
    if (p.Dv != p.Dk) t.push_back("dv_ne_dk");
  }
  if (p.kind == Kind::Sdpa)  // head_dim_128, or head_dim_192_128 (Dk, Dv) where they differ
    t.push_back("head_dim_" + std::to_string(p.Dk) + (p.Dv != p.Dk ? "_" + std::to_string(p.Dv) : ""));
  if (p.window) t.push_back("window");
  if (!p.softcap.empty()) t.push_back("softcap");
  if (!p.scale.empty()) t.push_back("scale");
  if (p.mask != MaskKind::None) t.push_back("mask_" + std::string(mask_kind_name(p.mask)));
  if (p.bias != BiasKind::None) t.push_back("bias_" + std::string(bias_kind_name(p.bias)));
  if (p.query_mask) t.push_back("query_mask");
  if (p.seqlens != SeqlensKind::None) {
    t.push_back("seqlens");
    t.push_back("seqlens_" + std::string(seqlens_kind_name(p.seqlens)));
  }
  if (p.poison) t.push_back("poison");
  if (p.masked_rows == MaskedRows::Zero) t.push_back("masked_rows_zero");
  if (p.want_weights) t.push_back("weights");
  if (p.want_lse) t.push_back("lse");
  if (p.want_scores) t.push_back("scores");
  if (p.wants_gradients()) {
    t.push_back("gradients");
    t.push_back("dout_" + p.dout);
  }
  if (!p.sinks.empty()) t.push_back("sinks");
  if (!p.rotary.empty()) {
    t.push_back("rotary");
    t.push_back("rotary_" + p.rotary);
  }
  if (p.page_size > 0) {
    t.push_back("paged");
    t.push_back("page_size_" + std::to_string(p.page_size));
    t.push_back(p.kv_layout_hnd ? "kv_layout_hnd" : "kv_layout_nhd");
    if (p.pages != ProblemSpec::Pages::Ordered)
      t.push_back(p.pages == ProblemSpec::Pages::Shared ? "pages_shared" : "pages_shuffled");
  }
  if (p.kv_split_size > 0) t.push_back("split_kv");
  if (p.want_out_partial || p.want_lse_partial) t.push_back("partials");
  if (!p.kv_format.empty()) {
    t.push_back("stored_kv");
    t.push_back("kv_" + lower(p.kv_format));
    if (p.kv_format != "mxfp8" && p.kv_format != "nvfp4")
      t.push_back("kv_scale_" + (p.kv_scale.empty() ? std::string("tensor") : p.kv_scale));
    if (p.kv_scale_binades > 0) t.push_back("kv_scale_binades");
  }
  if (p.v_from_k) t.push_back("v_from_k");
  if (!p.o_scale.empty()) t.push_back("o_scale");
  if (p.want_amax) t.push_back("amax");
  if (p.Nk >= 4096) t.push_back("long_rows");
  return t;
}

Suite parse_suite(const std::string& path, std::string_view text) {
  SpecReader r(path);
  return r.suite(r.parse(text));
}

Suite read_suite(const std::string& path) {
  const std::vector<unsigned char> bytes = read_regular_file(path, limits::kManifestBytes);
  return parse_suite(path, std::string(bytes.begin(), bytes.end()));
}

}  // namespace attnoracle::vectors
