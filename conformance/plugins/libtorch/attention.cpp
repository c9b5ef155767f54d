// Attention with libtorch (CPU) tensor ops, as an AttnOracle plugin (attnoracle/plugin.h).
// Everything is computed in the input dtype with the ops a PyTorch user would write: matmul,
// scalar multiply, tanh (softcap), masked_fill with -inf, softmax, logsumexp; gradients (dq, dk,
// dv, dbias; of kind mha dx_q, dx_kv, dw_q, dw_k, dw_v, dw_o, dbias) by autograd through those ops. Conventions are in README.md beside this file.
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attnoracle/plugin.h"

namespace {

// A case the plugin does not do (UNSUPPORTED) or refuses (REFUSED); other errors are FAILED.
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct Refused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::optional<torch::Dtype> torch_dtype(const std::string& name) {
  if (name == "F64") return torch::kFloat64;
  if (name == "F32") return torch::kFloat32;
  if (name == "F16") return torch::kFloat16;
  if (name == "BF16") return torch::kBFloat16;
  if (name == "BOOL") return torch::kBool;
  if (name == "I32") return torch::kInt32;  // seqlens_q, seqlens_k
  if (name == "I64") return torch::kInt64;
  return std::nullopt;
}

const char* dtype_name(torch::Dtype t) {
  switch (t) {
    case torch::kFloat64: return "F64";
    case torch::kFloat32: return "F32";
    case torch::kFloat16: return "F16";
    case torch::kBFloat16: return "BF16";
    default: return "?";
  }
}

// The case's tensors (viewing the host's memory, never written) and metadata.
struct Inputs {
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, std::string> meta;

  std::optional<torch::Tensor> get(const std::string& name) const {
    const auto it = tensors.find(name);
    return it == tensors.end() ? std::nullopt : std::optional<torch::Tensor>(it->second);
  }
  torch::Tensor need(const std::string& name) const {
    auto t = get(name);
    if (!t) throw std::runtime_error("tensor " + name + " is missing");
    return *t;
  }
  std::string meta_or(const std::string& key, const std::string& fallback) const {
    const auto it = meta.find(key);
    return it == meta.end() ? fallback : it->second;
  }
};

Inputs read_inputs(const attnoracle_case& c) {
  Inputs in;
  for (std::size_t t = 0; t < c.num_tensors; ++t) {
    const attnoracle_tensor& x = c.tensors[t];
    const auto type = torch_dtype(x.dtype);
    if (!type) throw Unsupported(std::string("tensor ") + x.name + " of dtype " + x.dtype);
    const std::vector<int64_t> shape(x.shape, x.shape + x.ndim);
    // from_blob wants a non-const pointer; the ops below only read their inputs.
    in.tensors[x.name] = torch::from_blob(const_cast<void*>(x.data), shape, *type);
  }
  for (std::size_t m = 0; m < c.num_metadata; ++m) in.meta[c.metadata[m].key] = c.metadata[m].value;
  return in;
}

double number(const std::string& key, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);  // decimal or C hex float
  if (text.empty() || *end != '\0' || !std::isfinite(v))
    throw std::runtime_error("bad " + key + " " + text);
  return v;
}

// The query rows that are not padding: query_mask and i < seqlens_q, as [B, 1, Nq].
torch::Tensor query_rows(const Inputs& in, int64_t B, int64_t Nq) {
  torch::Tensor query = torch::ones({B, 1, Nq}, torch::TensorOptions().dtype(torch::kBool));
  if (auto qm = in.get("query_mask")) query = qm->unsqueeze(1);
  if (auto lq = in.get("seqlens_q"))
    query = query & (torch::arange(Nq, torch::TensorOptions().dtype(torch::kInt64)).view({1, 1, Nq}) <
                     lq->to(torch::kInt64).view({B, 1, 1}));
  return query;
}

// Scaled dot-product attention, q [B,Hq,Nq,Dk], k [B,Hkv,Nk,Dk], v [B,Hkv,Nk,Dv].
struct Result {
  torch::Tensor out, weights, lse;
};

Result sdpa(torch::Tensor q, torch::Tensor k, torch::Tensor v, const Inputs& in) {
  const int64_t B = q.size(0), Hq = q.size(1), Nq = q.size(2), Dk = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2);
  if (Hkv < 1 || Hq % Hkv != 0) throw std::runtime_error("Hkv does not divide Hq");
  // GQA / MQA: query head h reads kv head h / (Hq / Hkv).
  if (Hkv != Hq) {
    k = k.repeat_interleave(Hq / Hkv, 1);
    v = v.repeat_interleave(Hq / Hkv, 1);
  }
  const auto dtype = q.scalar_type();
  const auto bool_opts = torch::TensorOptions().dtype(torch::kBool);
  const auto index_opts = torch::TensorOptions().dtype(torch::kInt64);

  // Scores: scale * Q K^T, softcap, bias.
  const double scale = in.meta.count("attn.scale") ? number("attn.scale", in.meta.at("attn.scale"))
                                                   : 1.0 / std::sqrt(static_cast<double>(Dk));
  torch::Tensor s = torch::matmul(q, k.transpose(-2, -1)) * scale;
  const double cap = number("attn.softcap", in.meta_or("attn.softcap", "0"));
  if (cap != 0) s = torch::tanh(s / cap) * cap;
  torch::Tensor allowed = torch::ones({1, 1, Nq, Nk}, bool_opts);
  if (auto bias = in.get("bias")) {
    allowed = allowed & (*bias != -INFINITY);
    s = s + bias->to(dtype);
  }
  if (auto mask = in.get("mask")) allowed = allowed & *mask;

  // Causal and window, 0-based; i' = i (top_left) or i + Lk - Lq (bottom_right), with Lk, Lq
  // the batch's seqlens_k, seqlens_q (Nk, Nq without them); keys j >= Lk are not allowed.
  const std::string causal = in.meta_or("attn.causal", "none");
  if (causal != "none" && causal != "top_left" && causal != "bottom_right")
    throw Unsupported("attn.causal " + causal);
  const auto length = [&](const char* name, int64_t n) {
    auto t = in.get(name);
    return (t ? t->to(torch::kInt64) : torch::full({B}, n, index_opts)).view({B, 1, 1, 1});
  };
  const torch::Tensor lq = length("seqlens_q", Nq), lk = length("seqlens_k", Nk);
  const auto i = torch::arange(Nq, index_opts).view({1, 1, Nq, 1}) +
                 (causal == "bottom_right" ? lk - lq : torch::zeros_like(lq));
  const auto j = torch::arange(Nk, index_opts).view({1, 1, 1, Nk});
  allowed = allowed & (j < lk);
  if (causal != "none") allowed = allowed & (j <= i);
  const std::string window = in.meta_or("attn.window", "none");
  if (window != "none") {
    long long left = 0, right = 0;
    char tail = 0;
    if (std::sscanf(window.c_str(), "%lld,%lld%c", &left, &right, &tail) != 2 || left < 0 ||
        right < 0)
      throw std::runtime_error("bad attn.window " + window);
    allowed =
        allowed & (j >= i - static_cast<int64_t>(left)) & (j <= i + static_cast<int64_t>(right));
  }
  allowed = allowed.expand({B, Hq, Nq, Nk});
  s = s.masked_fill(allowed.logical_not(), -INFINITY);

  // Fully masked rows: refused under policy error (padding rows excepted), else zeros.
  const torch::Tensor live = allowed.any(-1);  // [B, Hq, Nq]
  if (in.meta_or("attn.masked_rows", "error") == "error") {
    const torch::Tensor bad = torch::nonzero(live.logical_not() & query_rows(in, B, Nq));
    if (bad.size(0) > 0) {
      const auto at = [&](int64_t col) { return std::to_string(bad[0][col].item<int64_t>()); };
      throw Refused("fully masked row: b=" + at(0) + ", h=" + at(1) + ", i=" + at(2) +
                    " has no allowed key (attn.masked_rows=error)");
    }
  }
  // softmax of a row of -inf is NaN: those rows are set to 0 explicitly, their lse to -inf.
  // For the backward, those rows' scores go into softmax as 0 (finite), so that no NaN of
  // softmax's backward reaches dq, dk, dv or dbias; their weights are then masked to 0.
  const torch::Tensor dead = live.logical_not().unsqueeze(-1);
  Result r;
  r.weights = torch::softmax(s.masked_fill(dead, 0), -1).masked_fill(dead, 0);
  r.lse = torch::logsumexp(s, -1).masked_fill(live.logical_not(), -INFINITY);
  r.out = torch::matmul(r.weights, v);
  return r;
}

// Kind mha: per head projections, attention, heads concatenated (head 0 first), then W_o.
// The tensors come from `in` unless given (the autograd leaves of the backward).
Result mha(const Inputs& in, std::map<std::string, torch::Tensor> x = {}) {
  for (const char* name : {"x_q", "x_kv", "w_q", "w_k", "w_v", "w_o"})
    if (!x.count(name)) x[name] = in.need(name);
  // [B, 1, N, D] @ [H, D, E] -> [B, H, N, E]
  const auto project = [](const torch::Tensor& a, const torch::Tensor& w) {
    return torch::matmul(a.unsqueeze(1), w);
  };
  Result r = sdpa(project(x["x_q"], x["w_q"]), project(x["x_kv"], x["w_k"]),
                  project(x["x_kv"], x["w_v"]), in);
  const int64_t B = r.out.size(0), H = r.out.size(1), Nq = r.out.size(2), Dv = r.out.size(3);
  r.out = torch::matmul(r.out.transpose(1, 2).reshape({B, Nq, H * Dv}), x["w_o"]);
  return r;
}

const char* const kKnownKeys[] = {"attn.format",       "attn.kind",          "attn.scale",
                                  "attn.causal",       "attn.window",        "attn.softcap",
                                  "attn.masked_rows",  "attn.output_dtype",  "attn.output_dtypes",
                                  "attn.outputs"};

void check_metadata(const Inputs& in) {
  for (const auto& [key, value] : in.meta) {
    if (key.rfind("attn.", 0) != 0) continue;
    bool known = false;
    for (const char* k : kKnownKeys) known = known || key == k;
    if (!known) throw Unsupported("metadata key " + key);
  }
  if (in.meta_or("attn.format", "") != "1")
    throw Unsupported("attn.format " + in.meta_or("attn.format", "(none)"));
  const std::string rows = in.meta_or("attn.masked_rows", "error");
  if (rows != "error" && rows != "zero") throw Unsupported("attn.masked_rows " + rows);
}

// Emits a result tensor in the output dtype.
void emit(const attnoracle_sink& sink, const char* name, const torch::Tensor& t,
          torch::Dtype type) {
  const torch::Tensor c = t.to(type).contiguous();
  const std::vector<int64_t> shape(c.sizes().begin(), c.sizes().end());
  attnoracle_tensor x{name,         dtype_name(type), static_cast<int32_t>(shape.size()),
                      shape.data(), c.data_ptr(),     static_cast<uint64_t>(c.nbytes())};
  if (sink.emit(sink.ctx, &x) != 0)
    throw std::runtime_error(std::string("the host rejected ") + name);
}

// The names of attn.outputs, in order.
std::vector<std::string> output_names(const std::string& outputs) {
  std::vector<std::string> names;
  std::size_t from = 0;
  while (from <= outputs.size()) {
    const std::size_t comma = std::min(outputs.find(',', from), outputs.size());
    names.push_back(outputs.substr(from, comma - from));
    from = comma + 1;
  }
  return names;
}

bool is_gradient(const std::string& name) {
  return name == "dq" || name == "dk" || name == "dv" || name == "dbias" || name == "dx_q" ||
         name == "dx_kv" || name == "dw_q" || name == "dw_k" || name == "dw_v" || name == "dw_o";
}
// The gradients of each kind (dbias for both).
bool gradient_of(const std::string& name, const std::string& kind) {
  if (name == "dbias") return true;
  return (name[1] == 'x' || name[1] == 'w') == (kind == "mha");
}

int run(const attnoracle_case& c, const attnoracle_sink& sink) {
  const Inputs in = read_inputs(c);
  check_metadata(in);
  const std::string outputs = in.meta_or("attn.outputs", "out");
  const std::vector<std::string> names = output_names(outputs);
  bool gradients = false;
  for (const auto& name : names) {
    if (name != "out" && name != "weights" && name != "lse" && !is_gradient(name))
      throw Unsupported("attn.outputs " + outputs);
    gradients = gradients || is_gradient(name);
  }
  if (in.tensors.count("sinks"))
    throw Unsupported(gradients ? "sinks: this plugin has no sink logits (nor their gradients)"
                                : "sinks: this plugin has no sink logits");
  const std::string kind = in.meta_or("attn.kind", "sdpa");
  if (kind != "sdpa" && kind != "mha") throw Unsupported("attn.kind " + kind);
  for (const auto& name : names)
    if (is_gradient(name) && !gradient_of(name, kind))
      throw Refused("attn.outputs: " + name + " is not a gradient of kind " + kind);
  const torch::Tensor first = in.need(kind == "sdpa" ? "q" : "x_q");
  const auto in_type = first.scalar_type();
  const auto out_type = torch_dtype(in.meta_or("attn.output_dtype", dtype_name(in_type)));
  if (!out_type || *out_type == torch::kBool)
    throw Unsupported("attn.output_dtype " + in.meta_or("attn.output_dtype", ""));
  // attn.output_dtypes (name:DTYPE,...): an output's own dtype, over the output dtype
  std::map<std::string, torch::Dtype> own;
  const std::string listed = in.meta_or("attn.output_dtypes", "");
  for (const auto& entry : listed.empty() ? std::vector<std::string>{} : output_names(listed)) {
    const auto colon = entry.find(':');
    const auto t = colon == std::string::npos ? std::nullopt : torch_dtype(entry.substr(colon + 1));
    if (!t || *t == torch::kBool || *t == torch::kInt32 || *t == torch::kInt64)
      throw Unsupported("attn.output_dtypes " + listed);
    own[entry.substr(0, colon)] = *t;
  }
  const auto type_of = [&](const std::string& name) { return own.count(name) ? own.at(name) : *out_type; };
  for (const auto& [name, t] : in.tensors)
    if (name != "mask" && name != "query_mask" && name != "bias" && name != "seqlens_q" &&
        name != "seqlens_k" && name != "dout" && t.scalar_type() != in_type)
      throw std::runtime_error("tensor " + name + " differs in dtype from " + dtype_name(in_type));

  Result r;
  std::map<std::string, torch::Tensor> grads;
  if (!gradients) {
    torch::NoGradGuard no_grad;
    r = kind == "sdpa" ? sdpa(in.need("q"), in.need("k"), in.need("v"), in) : mha(in);
  } else if (kind == "mha") {
    // Autograd through the same forward: x_q, x_kv, the weights (and bias) as leaves. In
    // self-attention (x_q and x_kv equal) one leaf x is both, so x's grad holds both paths.
    const auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
    Inputs g = in;
    std::map<std::string, torch::Tensor> x;
    for (const char* name : {"x_q", "x_kv", "w_q", "w_k", "w_v", "w_o"}) x[name] = leaf(in.need(name));
    const bool self = in.need("x_q").sizes() == in.need("x_kv").sizes() &&
                      torch::equal(in.need("x_q"), in.need("x_kv"));
    if (self) x["x_kv"] = x["x_q"];
    torch::Tensor bias;
    if (auto b = in.get("bias")) g.tensors["bias"] = bias = leaf(b->to(in_type));
    r = mha(g, x);
    torch::Tensor dout = in.need("dout");
    if (dout.sizes() != r.out.sizes()) throw std::runtime_error("dout is not shaped as out [B, Nq, Dout]");
    // query_rows is [B, 1, Nq]: out [B, Nq, Dout] takes it as [B, Nq, 1]
    const torch::Tensor pad = query_rows(in, r.out.size(0), r.out.size(1)).squeeze(1).logical_not().unsqueeze(-1);
    dout = dout.to(in_type).masked_fill(pad, 0);
    r.out.backward(dout);
    for (const char* name : {"x_q", "x_kv", "w_q", "w_k", "w_v", "w_o"})
      if (!(self && std::string(name) == "x_kv")) grads[std::string("d") + name] = x[name].grad();
    if (bias.defined()) grads["dbias"] = bias.grad();
  } else {
    // Autograd through the same forward: q, k, v (and bias) as leaves, out.backward(dout).
    // repeat_interleave's backward sums a kv head's query heads (GQA), the broadcast add of the
    // bias sums over its broadcast dimensions.
    const auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
    Inputs g = in;
    const torch::Tensor q = leaf(in.need("q")), k = leaf(in.need("k")), v = leaf(in.need("v"));
    torch::Tensor bias;
    // The bias leaf in the compute dtype (as the forward adds it), so dbias is not rounded to a
    // narrower bias dtype (an F32 bias of an F64 case) before the output dtype.
    if (auto b = in.get("bias")) g.tensors["bias"] = bias = leaf(b->to(in_type));
    r = sdpa(q, k, v, g);
    torch::Tensor dout = in.need("dout");
    if (dout.sizes() != r.out.sizes())
      throw std::runtime_error("dout is not shaped as out [B, Hq, Nq, Dv]");
    // Padding rows contribute nothing: their dout (which may hold anything) is set to 0.
    const torch::Tensor pad = query_rows(in, q.size(0), q.size(2)).logical_not().unsqueeze(-1);
    dout = dout.to(in_type).masked_fill(pad, 0);
    r.out.backward(dout);
    grads = {{"dq", q.grad()}, {"dk", k.grad()}, {"dv", v.grad()}};
    if (bias.defined()) grads["dbias"] = bias.grad();
  }

  torch::NoGradGuard no_grad;
  for (const auto& name : names) {
    if (name == "out")
      emit(sink, "out", r.out, type_of(name));
    else if (name == "weights")
      emit(sink, "weights", r.weights, type_of(name));
    else if (name == "lse")
      emit(sink, "lse", r.lse, type_of(name));
    else if (!grads.count(name))
      throw std::runtime_error(name + (name == "dx_kv" ? " asked for in self-attention (dx_q holds it)"
                                                       : " asked for, but the case has no bias"));
    else
      emit(sink, name.c_str(), grads.at(name), type_of(name));
  }
  return ATTNORACLE_OK;
}

int say(int status, char* message, std::size_t size, const std::string& text) {
  std::snprintf(message, size, "%s", text.c_str());
  return status;
}

}  // namespace

extern "C" {

ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_abi(void) { return ATTNORACLE_PLUGIN_ABI; }

ATTNORACLE_PLUGIN_EXPORT const char* attnoracle_plugin_name(void) {
  return "libtorch " TORCH_VERSION;
}

ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_run(const attnoracle_case* c,
                                                   const attnoracle_sink* sink, char* message,
                                                   size_t message_size) {
  try {
    return run(*c, *sink);
  } catch (const Unsupported& e) {
    return say(ATTNORACLE_UNSUPPORTED, message, message_size, e.what());
  } catch (const Refused& e) {
    return say(ATTNORACLE_REFUSED, message, message_size, e.what());
  } catch (const c10::Error& e) {
    // An op without a kernel for this dtype on CPU ("bmm" not implemented for 'Half').
    const std::string what = e.what_without_backtrace();
    const bool missing_kernel = what.find("not implemented for") != std::string::npos;
    return say(missing_kernel ? ATTNORACLE_UNSUPPORTED : ATTNORACLE_FAILED, message, message_size,
               (missing_kernel ? "libtorch CPU: " : "") + what.substr(0, what.find('\n')));
  } catch (const std::exception& e) {
    return say(ATTNORACLE_FAILED, message, message_size, e.what());
  } catch (...) {
    return say(ATTNORACLE_FAILED, message, message_size, "unknown exception");
  }
}

}  // extern "C"
