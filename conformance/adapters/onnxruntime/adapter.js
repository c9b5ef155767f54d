#!/usr/bin/env node
'use strict';
// ONNX Runtime's CPU `Attention` operator (opset 23, npm package onnxruntime-node) as an
// AttnOracle adapter (CONTRACT section 5).
//
//   node conformance/adapters/onnxruntime/adapter.js [--threads N] [--f64] JOBS.jsonl
//
// Each line of JOBS.jsonl is {"id": ..., "input": path, "output": path}. For each job it writes
// exactly one of `output` (a safetensors file with `out`, and `weights` when the case asks for
// them), `output.error` (the case failed; the text says why) or `output.unsupported` (the text
// names the feature or dtype). Exit status 0 once the list is done; 2 when onnxruntime-node
// cannot be loaded (nothing is written then) or the command line is wrong.
//
// Per case it builds a small ONNX graph by hand (onnx_model.js) and runs it:
//   sdpa: Attention(q, k, v, attn_mask[, '', '', nonpad_kv_seqlen]) [-> Cast to the output dtype]
//   mha:  MatMul(x_q[B,1,Nq,D], w_q[H,D,Dk]) -> Q[B,H,Nq,Dk] (likewise K, V from x_kv),
//         Attention(Q, K, V, attn_mask) -> [B,H,Nq,Dv], Transpose -> [B,Nq,H,Dv],
//         Reshape -> [B,Nq,H*Dv], MatMul w_o -> [B,Nq,Dout] [-> Cast]
// The boolean mask, the causal option (either alignment), the window and a bias are folded into
// ONE attn_mask [1 or B, 1 or Hq, Nq, Nk] in the input dtype: the bias where the key is allowed,
// -inf where it is not; with no bias, a boolean attn_mask (true = may attend) instead. GQA/MQA
// goes through Hkv < Hq (ONNX Runtime maps query head h to kv head h * Hkv / Hq = h / (Hq/Hkv)).
// `weights` is the Attention node's fourth output with qk_matmul_output_mode = 3 (after softmax).
// `lse` is not available from the operator and is not written. seqlens_k becomes the operator's
// nonpad_kv_seqlen (then the graph is opset 24). Sinks go to GroupQueryAttention's head_sink
// (--op gqa); Attention and MultiHeadAttention have no sink input. Gradients are unsupported.

const fs = require('fs');
const path = require('path');
const st = require('./safetensors');
const onnx = require('./onnx_model');

const KEYS = new Set(['attn.format', 'attn.kind', 'attn.scale', 'attn.causal', 'attn.window',
  'attn.softcap', 'attn.masked_rows', 'attn.output_dtype', 'attn.output_dtypes', 'attn.outputs',
  'attn.reference', 'attn.undecided']);   // the last two: added by eval to golden files, ignored
// Dtypes ONNX Runtime's CPU Attention kernel is registered for (float, MLFloat16).
const KERNEL_TYPES = { F32: { elem: onnx.FLOAT, name: 'float32' }, F16: { elem: onnx.FLOAT16, name: 'float16' } };
// With --f64: ONNX Runtime has no CPU Attention kernel for double; the session falls back to the
// operator's ONNX function body (MatMul, Softmax, ...) expanded in double. Its conventions differ
// (README): opt-in, to be registered as an implementation of its own.
const F64_TYPE = { elem: onnx.DOUBLE, name: 'float64' };
let ORT_TYPES = KERNEL_TYPES;
// --op: the standard Attention (default), or the contrib MultiHeadAttention or GroupQueryAttention.
let OP = 'attention';
const OPS = ['attention', 'mha', 'gqa'];
const OP_NAMES = { attention: 'Attention', mha: 'MultiHeadAttention', gqa: 'GroupQueryAttention' };
const FLOATS = new Set(['F64', 'F32', 'F16', 'BF16']);
// The gradients a case may ask for in attn.outputs (CONTRACT section 7).
const GRADIENTS = new Set(['dq', 'dk', 'dv', 'dbias', 'dsinks', 'dx_q', 'dx_kv', 'dw_q', 'dw_k', 'dw_v', 'dw_o']);

class Unsupported extends Error {}
class BadCase extends Error {}

// ---- numbers --------------------------------------------------------------------------------

const FLOAT32_MAX = 3.4028234663852886e38;

function bitLength(n) {
  return n === 0n ? 0 : n.toString(2).length;
}

/** num/den (BigInt, both > 0) rounded once, to nearest-even, to float32; returned as a double. */
function rationalToFloat32(num, den) {
  const p = 24;
  let e = bitLength(num) - bitLength(den);           // floor(log2(num/den)) is e or e - 1
  const below = e >= 0 ? num < (den << BigInt(e)) : (num << BigInt(-e)) < den;
  if (below) e -= 1;
  e = Math.max(e, -126);                             // subnormals: the spacing stops shrinking
  const s = p - 1 - e;                               // num/den * 2^s has p bits before the point
  const n2 = s >= 0 ? num << BigInt(s) : num;
  const d2 = s >= 0 ? den : den << BigInt(-s);
  let q = n2 / d2;
  const twice = 2n * (n2 % d2);
  if (twice > d2 || (twice === d2 && (q & 1n) === 1n)) q += 1n;
  const r = Number(q) * 2 ** (e - p + 1);            // exact: q <= 2^24, a power of two
  return r > FLOAT32_MAX ? Infinity : r;
}

/**
 * The exact value of a decimal or C hex float text ("0.125", "1e-3", "0x1.6a09e667f3bcdp-3")
 * as {negative, num, den} (BigInt num >= 0, den > 0). Throws BadCase on other text.
 */
function parseExact(text, what) {
  const t = String(text).trim();
  let m = /^([+-]?)0[xX]([0-9a-fA-F]*)(?:\.([0-9a-fA-F]*))?[pP]([+-]?\d+)$/.exec(t);
  let num; let exp; let base;
  if (m && (m[2] || m[3])) {
    const frac = m[3] || '';
    num = BigInt(`0x${(m[2] || '') + frac}`);
    exp = Number(m[4]) - 4 * frac.length;
    base = 2n;
  } else {
    m = /^([+-]?)(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?$/.exec(t);
    if (!m || !(m[2] || m[3])) throw new BadCase(`${what}: ${JSON.stringify(text)} is not a number`);
    const frac = m[3] || '';
    num = BigInt((m[2] || '') + frac);
    exp = Number(m[4] || 0) - frac.length;
    base = 10n;
  }
  if (Math.abs(exp) > 5000) throw new Unsupported(`${what} ${text}: exponent out of range`);
  let den = 1n;
  if (exp >= 0) num *= base ** BigInt(exp); else den = base ** BigInt(-exp);
  return { negative: m[1] === '-', num, den };
}

/** The value of a number text rounded once, to nearest-even, to float32 (ONNX float attributes). */
function textToFloat32(text, what) {
  const { negative, num, den } = parseExact(text, what);
  const r = num === 0n ? 0 : rationalToFloat32(num, den);
  return negative ? -r : r;
}

// ---- the case -------------------------------------------------------------------------------

/** Shape padded on the left with 1s to rank 4, and the element strides broadcasting it to 4-D. */
function broadcastStrides(shape, target, name) {
  if (shape.length > 4) throw new BadCase(`${name}: rank ${shape.length} > 4`);
  const s = [...Array(4 - shape.length).fill(1), ...shape];
  const strides = [0, 0, 0, 0];
  let step = 1;
  for (let d = 3; d >= 0; d--) {
    if (s[d] !== 1 && s[d] !== target[d]) {
      throw new BadCase(`${name}: shape [${shape}] does not broadcast to [${target}]`);
    }
    strides[d] = s[d] === 1 ? 0 : step;
    step *= s[d];
  }
  return { padded: s, strides };
}

/**
 * The graph's outputs: finish(name, shape, resultName) adds a node output (cast to that result's
 * dtype, types[resultName], when it differs from the input's) and the result it becomes.
 */
function graphOutputs(nodes, inType, types) {
  const outputs = [];
  const results = [];
  const finish = (name, shape, resultName) => {
    let final = name;
    const dtype = types[resultName];
    const elem = ORT_TYPES[dtype].elem;
    if (dtype !== inType) {
      final = `${name}_cast`;
      nodes.push(onnx.node('Cast', [name], [final], { to: { i: elem } }, `cast_${name}`));
    }
    outputs.push(onnx.valueInfo(final, elem, shape));
    results.push({ ort: final, name: resultName, dtype });
  };
  return { outputs, results, finish };
}

/**
 * The attn_mask: null when there is nothing to mask or add; else {type (onnxruntime-node tensor
 * type), elem (ONNX data type), shape [mb, mh, Nq, Nk] (mb in {1, B}, mh in {1, Hq}), data}:
 * boolean (true = may attend) without a bias, else the bias in the input dtype with -inf where
 * the key is not allowed.
 */
function buildMask(tensors, meta, dims, inType, { causal = meta['attn.causal'] || 'none',
  window = meta['attn.window'] || 'none', float = false, keyLengths = true } = {}) {
  const [B, H, Nq, Nk] = dims;
  const mask = tensors.mask;
  const bias = tensors.bias;
  // Sequence lengths [B]: keys j >= seqlens_k[b] masked (unless keyLengths is false: the
  // operator's nonpad_kv_seqlen masks them), bottom_right aligned per batch.
  const lengths = (name, n) => (tensors[name] ? Array.from(st.values(tensors[name])) : new Array(B).fill(n));
  const varlen = Boolean(tensors.seqlens_q || tensors.seqlens_k);
  const lq = lengths('seqlens_q', Nq);
  const lk = lengths('seqlens_k', Nk);
  if (!mask && !bias && causal === 'none' && window === 'none' && !(keyLengths && tensors.seqlens_k)) return null;

  const parts = [];
  if (mask) {
    if (mask.dtype !== 'BOOL') throw new BadCase(`mask: dtype ${mask.dtype}, expected BOOL`);
    parts.push({ t: mask, ...broadcastStrides(mask.shape, dims, 'mask') });
  }
  let biasValues = null;
  if (bias) {
    if (!FLOATS.has(bias.dtype)) throw new BadCase(`bias: dtype ${bias.dtype}`);
    parts.push({ t: bias, ...broadcastStrides(bias.shape, dims, 'bias') });
    biasValues = st.values(bias);
  }
  const mb = varlen || parts.some((p) => p.padded[0] !== 1) ? B : 1;
  const mh = parts.some((p) => p.padded[1] !== 1) ? H : 1;

  // Causal and window, 0-based; i' = i (top_left, and windows with no causal) or i + Lk - Lq,
  // the lengths of the batch's sequences (Nk and Nq without seqlens).
  const shift = (b) => (causal === 'bottom_right' ? lk[b] - lq[b] : 0);
  let left = Infinity; let right = Infinity;
  if (window !== 'none') {
    const m = /^(\d+),(\d+)$/.exec(window);
    if (!m) throw new BadCase(`attn.window: ${JSON.stringify(window)} is not "none" or "L,R"`);
    left = Number(m[1]);
    right = Number(m[2]);
  }
  const positional = (b, i, j) => {
    if (keyLengths && j >= lk[b]) return false;
    const ip = i + shift(b);
    if (causal !== 'none' && j > ip) return false;
    return ip - left <= j && j <= ip + right;
  };

  const n = mb * mh * Nq * Nk;
  const allowed = new Uint8Array(n);
  const added = bias || float ? new Float64Array(n) : null;
  const ms = mask ? parts[0].strides : null;
  const bs = bias ? parts[parts.length - 1].strides : null;
  let at = 0;
  for (let b = 0; b < mb; b++) {
    for (let h = 0; h < mh; h++) {
      for (let i = 0; i < Nq; i++) {
        for (let j = 0; j < Nk; j++, at++) {
          let ok = positional(b, i, j);
          if (ok && mask) ok = mask.data[b * ms[0] + h * ms[1] + i * ms[2] + j * ms[3]] !== 0;
          if (bias) {
            const x = biasValues[b * bs[0] + h * bs[1] + i * bs[2] + j * bs[3]];
            if (x === -Infinity) ok = false;
            added[at] = ok ? x : -Infinity;
          } else if (float) added[at] = ok ? 0 : -Infinity;
          allowed[at] = ok ? 1 : 0;
        }
      }
    }
  }
  const shape = [mb, mh, Nq, Nk];
  if (!bias && !float) return { type: 'bool', elem: onnx.BOOL, shape, data: allowed };
  // The bias is rounded once, to nearest-even, into the input dtype (attn_mask has the type of Q).
  return { type: ORT_TYPES[inType].name, elem: ORT_TYPES[inType].elem, shape, data: roundInto(added, inType) };
}

/** Numbers rounded once, to nearest-even, into F64, F32 or F16 (as bits) -> the typed array. */
function roundInto(values, dtype) {
  if (dtype === 'F64') return Float64Array.from(values);
  if (dtype === 'F32') return Float32Array.from(values);
  return Uint16Array.from(values, (x) => st.numberToHalf(x));
}

/** Parses and checks what the adapter needs -> a plan: graph pieces, feeds, output names. */
function plan(tensors, meta) {
  // A paged KV cache (k_cache, v_cache, block_table): the graphs here take contiguous k and v only.
  const paged = ['k_cache', 'v_cache', 'block_table'].filter((n) => tensors[n]);
  if (paged.length) throw new Unsupported(`paged KV cache (${paged.join(', ')}): the ONNX graphs of this adapter take contiguous k and v`);
  // Empty shapes (B, Nq or Nk = 0): not handed to ONNX Runtime, whose kernels are not known to accept them.
  for (const [name, t] of Object.entries(tensors)) {
    if (['q', 'k', 'v', 'x_q', 'x_kv'].includes(name) && t.shape.some((n) => n === 0)) {
      throw new Unsupported(`empty shape: ${name} is [${t.shape.join(',')}]`);
    }
  }
  // Split-KV (CONTRACT section 8): no ONNX Runtime operator returns partial states or combines them.
  if (meta['attn.kind'] === 'merge') throw new Unsupported('attn.kind merge: ONNX Runtime has no operator combining split-KV partial states');
  if (meta['attn.kv_split_size'] !== undefined) throw new Unsupported('attn.kv_split_size: ONNX Runtime attention returns no split-KV partial states (out_partial, lse_partial)');
  for (const key of Object.keys(meta)) {
    if (key.startsWith('attn.') && !KEYS.has(key)) throw new Unsupported(`metadata key ${key}`);
  }
  if (meta['attn.format'] !== '1') throw new Unsupported(`attn.format ${JSON.stringify(meta['attn.format'])}`);
  const asked = (meta['attn.outputs'] || 'out').split(',').map((s) => s.trim());
  const grads = asked.filter((o) => GRADIENTS.has(o));
  if (grads.length) throw new Unsupported(`gradients: ONNX Runtime inference has no backward (attn.outputs asks for ${grads.join(', ')})`);
  const kind = meta['attn.kind'] || 'sdpa';
  if (kind !== 'sdpa' && kind !== 'mha') throw new Unsupported(`attn.kind ${kind}`);
  const causal = meta['attn.causal'] || 'none';
  if (!['none', 'top_left', 'bottom_right'].includes(causal)) throw new Unsupported(`attn.causal ${causal}`);
  const policy = meta['attn.masked_rows'] || 'error';
  if (!['error', 'zero'].includes(policy)) throw new Unsupported(`attn.masked_rows ${policy}`);

  const need = (name) => {
    if (!tensors[name]) throw new BadCase(`tensor ${name} is missing (attn.kind ${kind})`);
    return tensors[name];
  };
  const main = kind === 'sdpa' ? ['q', 'k', 'v'] : ['x_q', 'w_q', 'w_k', 'w_v', 'w_o'];
  for (const name of main) need(name);
  if (kind === 'mha' && !tensors.x_kv) tensors.x_kv = tensors.x_q;
  const inType = tensors[main[0]].dtype;
  const outType = meta['attn.output_dtype'] || inType;
  for (const name of [...main, ...(kind === 'mha' ? ['x_kv'] : [])]) {
    if (tensors[name].dtype !== inType) {
      throw new BadCase(`tensor ${name}: dtype ${tensors[name].dtype}, the other inputs are ${inType}`);
    }
  }
  if (!(inType in ORT_TYPES)) {
    throw new Unsupported(`ONNX Runtime CPU ${OP_NAMES[OP]}: ${inType} inputs not supported (float and float16 kernels only`
      + `${inType === 'F64' && OP === 'attention' ? '; --f64 runs the operator\'s function body in double' : ''})`);
  }
  // Each written output's dtype: attn.output_dtypes (name:DTYPE,...) over attn.output_dtype.
  const types = { out: outType, weights: outType };
  for (const entry of meta['attn.output_dtypes'] !== undefined ? meta['attn.output_dtypes'].split(',') : []) {
    const [name, dtype] = entry.split(':');
    if (name in types) types[name] = dtype;
  }
  for (const [name, dtype] of Object.entries(types)) {
    if ((name === 'out' || asked.includes(name)) && !(dtype in ORT_TYPES)) {
      throw new Unsupported(`${name === 'out' && dtype === outType ? 'output dtype' : `attn.output_dtypes: ${name} in`} ${dtype}: `
        + `this adapter writes ${Object.keys(ORT_TYPES).join(' or ')} only`);
    }
  }
  for (const name of ['seqlens_q', 'seqlens_k']) {
    const t = tensors[name];
    if (!t) continue;
    if (t.dtype !== 'I32' && t.dtype !== 'I64') throw new BadCase(`${name}: dtype ${t.dtype}, expected I32 or I64`);
  }
  // Only GroupQueryAttention has a sink input (head_sink); Attention (opsets 23, 24) and
  // MultiHeadAttention have none.
  if (tensors.sinks) {
    if (OP !== 'gqa') {
      throw new Unsupported(`sinks: ${OP_NAMES[OP]} has no sink input (GroupQueryAttention's head_sink, --op gqa, has)`);
    }
    const t = tensors.sinks;
    if (!FLOATS.has(t.dtype)) throw new BadCase(`sinks: dtype ${t.dtype}, expected a float dtype`);
    const heads = kind === 'sdpa' ? tensors.q.shape[1] : tensors.w_q.shape[0];
    if (t.shape.length !== 1 || t.shape[0] !== heads) throw new BadCase(`sinks: shape [${t.shape}], expected [${heads}]`);
  }
  for (const o of asked) {
    if (o === 'scores') throw new Unsupported('attn.outputs scores: not read from the ONNX Runtime graph');
    if (!['out', 'weights', 'lse'].includes(o)) throw new Unsupported(`attn.outputs ${o}`);
  }
  const wantWeights = asked.includes('weights');

  const attrs = {};
  if (meta['attn.scale'] !== undefined) {
    const scale = textToFloat32(meta['attn.scale'], 'attn.scale');
    if (!(scale > 0) || scale === Infinity) {
      throw new Unsupported(`attn.scale ${meta['attn.scale']}: ONNX Runtime needs a scale > 0 that is finite in float32`);
    }
    attrs.scale = { f: scale };
  }
  if (meta['attn.softcap'] !== undefined) {
    const exact = parseExact(meta['attn.softcap'], 'attn.softcap');
    const cap = textToFloat32(meta['attn.softcap'], 'attn.softcap');
    if (exact.negative && exact.num !== 0n) throw new BadCase(`attn.softcap ${meta['attn.softcap']}: must be >= 0`);
    if (exact.num !== 0n) {
      if (cap === 0 || cap === Infinity) {
        throw new Unsupported(`attn.softcap ${meta['attn.softcap']}: not a finite nonzero float32`);
      }
      attrs.softcap = { f: cap };
    }
  }
  if (wantWeights) attrs.qk_matmul_output_mode = { i: 3 };

  const T = ORT_TYPES[inType];
  const shapeOf = (name) => tensors[name].shape;
  const nodes = [];
  const inputs = [];
  const feeds = [];
  const initializers = [];
  const feed = (name, tensor, shape) => {
    inputs.push(onnx.valueInfo(name, T.elem, shape));
    feeds.push({ name, type: T.name, data: tensor.data, shape });
  };

  let dims; let qName; let kName; let vName; let outShape;
  let H; let Nq; let Dv;
  if (kind === 'sdpa') {
    const [B, Hq, Nq_, Dk] = shapeOf('q');
    const [Bk, Hkv, Nk, Dk2] = shapeOf('k');
    const [Bv, Hkv2, Nk2, Dv_] = shapeOf('v');
    if (shapeOf('q').length !== 4 || shapeOf('k').length !== 4 || shapeOf('v').length !== 4) {
      throw new BadCase('q, k, v must have rank 4');
    }
    if (Bk !== B || Bv !== B || Hkv2 !== Hkv || Nk2 !== Nk || Dk2 !== Dk || Hq % Hkv !== 0) {
      throw new BadCase(`shapes q [${shapeOf('q')}], k [${shapeOf('k')}], v [${shapeOf('v')}] do not agree`);
    }
    feed('q', tensors.q, shapeOf('q'));
    feed('k', tensors.k, shapeOf('k'));
    feed('v', tensors.v, shapeOf('v'));
    [qName, kName, vName] = ['q', 'k', 'v'];
    dims = [B, Hq, Nq_, Nk];
    [H, Nq, Dv] = [Hq, Nq_, Dv_];
    outShape = [B, Hq, Nq_, Dv_];
  } else {
    const [B, Nq_, D] = shapeOf('x_q');
    const [Bkv, Nk, Dkv] = shapeOf('x_kv');
    const [Hw, Dw, Dk] = shapeOf('w_q');
    const [Hv, Dwv, Dv_] = shapeOf('w_v');
    const [HDv, Dout] = shapeOf('w_o');
    const wk = shapeOf('w_k');
    if (Bkv !== B || Dkv !== D || Dw !== D || Dwv !== D || Hv !== Hw || wk.join() !== [Hw, D, Dk].join()
        || HDv !== Hw * Dv_) {
      throw new BadCase('mha: shapes of x_q, x_kv, w_q, w_k, w_v, w_o do not agree');
    }
    // X [B,N,D] is fed as [B,1,N,D] (the same data): MatMul broadcasts it against W [H,D,Dk].
    feed('x_q', tensors.x_q, [B, 1, Nq_, D]);
    feed('x_kv', tensors.x_kv, [B, 1, Nk, D]);
    feed('w_q', tensors.w_q, shapeOf('w_q'));
    feed('w_k', tensors.w_k, shapeOf('w_k'));
    feed('w_v', tensors.w_v, shapeOf('w_v'));
    feed('w_o', tensors.w_o, shapeOf('w_o'));
    nodes.push(onnx.node('MatMul', ['x_q', 'w_q'], ['Q'], {}, 'project_q'));
    nodes.push(onnx.node('MatMul', ['x_kv', 'w_k'], ['K'], {}, 'project_k'));
    nodes.push(onnx.node('MatMul', ['x_kv', 'w_v'], ['V'], {}, 'project_v'));
    [qName, kName, vName] = ['Q', 'K', 'V'];
    dims = [B, Hw, Nq_, Nk];
    [H, Nq, Dv] = [Hw, Nq_, Dv_];
    outShape = [B, Nq_, Dout];
  }

  if (OP !== 'attention') {
    return contribPlan({ tensors, meta, kind, inType, types, T, attrs, wantWeights, dims, Dv,
      names: [qName, kName, vName], dk: kind === 'sdpa' ? shapeOf('q')[3] : shapeOf('w_q')[2],
      nodes, inputs, feeds, initializers });
  }
  // seqlens_k becomes Attention's nonpad_kv_seqlen (opset 24, int64 only): keys j >= seqlens_k[b]
  // are left out by the operator, the same result bit for bit as masking them (measured).
  const nonpad = Boolean(tensors.seqlens_k);
  const mask = buildMask(tensors, meta, dims, inType, { keyLengths: !nonpad });
  const attnInputs = [qName, kName, vName, mask ? 'attn_mask' : '', '', '', nonpad ? 'nonpad_kv_seqlen' : ''];
  while (attnInputs[attnInputs.length - 1] === '') attnInputs.pop();
  if (mask) {
    inputs.push(onnx.valueInfo('attn_mask', mask.elem, mask.shape));
    feeds.push({ name: 'attn_mask', type: mask.type, data: mask.data, shape: mask.shape });
  }
  if (nonpad) {
    const B = dims[0];
    if (tensors.seqlens_k.shape.join() !== String(B)) {
      throw new BadCase(`seqlens_k: shape [${tensors.seqlens_k.shape}], expected [${B}]`);
    }
    inputs.push(onnx.valueInfo('nonpad_kv_seqlen', onnx.INT64, [B]));
    feeds.push({ name: 'nonpad_kv_seqlen', type: 'int64', data: BigInt64Array.from(tensors.seqlens_k.data, BigInt), shape: [B] });
  }
  const attnOut = kind === 'sdpa' ? 'y' : 'heads';
  nodes.push(onnx.node('Attention', attnInputs, wantWeights ? [attnOut, '', '', 'w'] : [attnOut],
    attrs, 'attention'));
  let outName = attnOut;
  if (kind === 'mha') {
    const [B] = dims;
    nodes.push(onnx.node('Transpose', ['heads'], ['heads_t'], { perm: { ints: [0, 2, 1, 3] } }, 'heads_last'));
    initializers.push(onnx.tensor('concat_shape', onnx.INT64, [3], BigInt64Array.from([B, Nq, H * Dv].map(BigInt))));
    nodes.push(onnx.node('Reshape', ['heads_t', 'concat_shape'], ['concat'], {}, 'concat_heads'));
    nodes.push(onnx.node('MatMul', ['concat', 'w_o'], ['y'], {}, 'project_out'));
    outName = 'y';
  }
  const { outputs, results, finish } = graphOutputs(nodes, inType, types);
  finish(outName, outShape, 'out');
  if (wantWeights) finish('w', dims, 'weights');

  const model = onnx.model({ nodes, inputs, outputs, initializers }, { opset: nonpad ? 24 : 23 });
  return { model, feeds, results };
}

// ---- the contrib operators (--op mha, --op gqa) ----------------------------------------------
//
// Both take Q, K, V as [B, N, H*D] (head 0 first): the 4-D q, k, v (or the projections of kind
// mha) go through Transpose [0,2,1,3] and Reshape, and the [B, Nq, Hq*Dv] result comes back the
// same way (kind mha: straight into the MatMul by w_o). Mask, bias, sequence lengths, and the
// causal option and window where the operator has no attribute for them (always, with sequence
// lengths), become one attention_bias of type T [1 or B, 1 or Hq, Nq, Nk]: the bias (0 without
// one) where the key may be attended, -inf where not.
//   mha: MultiHeadAttention(q, k, v, '', '', attention_bias), num_heads = Hq; causal through
//        unidirectional = 1 when the alignments agree (top_left, or Nq = Nk), else in the bias.
//        No GQA, no softcap, no weights, no sinks.
//   gqa: GroupQueryAttention(q, k, v, past_key, past_value, seqlens_k, total_sequence_length,
//        '', '', '', attention_bias, head_sink); sinks in head_sink [Hq], of type T; its
//        seqlens_k is Nk - 1 for every batch element. The first Nk - Nq keys and values are
//        the past (BNSH), the last Nq the new tokens, so the operator's causal mask (causal = 1) is
//        bottom-right aligned; top_left with Nq != Nk goes through the bias with causal = 0.
//        A window "L,R" with causal becomes local_window_size = L + 1. Needs Dk = Dv, a multiple
//        of 8, and Nq <= Nk; with 1 < Nq < Nk (batch 1 only, for the operator) one node per batch
//        element, the results concatenated.

function contribPlan(c) {
  const { tensors, meta, kind, inType, types, wantWeights, nodes, inputs, feeds, initializers } = c;
  const [B, Hq, Nq, Nk] = c.dims;
  const Dk = c.dk;
  const { Dv } = c;
  const Hkv = kind === 'sdpa' ? tensors.k.shape[1] : Hq;
  const causal = meta['attn.causal'] || 'none';
  const window = meta['attn.window'] || 'none';
  const opName = OP_NAMES[OP];
  const int64 = (name, values) => {
    initializers.push(onnx.tensor(name, onnx.INT64, [values.length], BigInt64Array.from(values.map(BigInt))));
    return name;
  };
  const toBSD = (name, Bn, H, N, D) => {
    nodes.push(onnx.node('Transpose', [name], [`${name}_bnhd`], { perm: { ints: [0, 2, 1, 3] } }, `${name}_heads_inner`));
    nodes.push(onnx.node('Reshape', [`${name}_bnhd`, int64(`${name}_bsd_shape`, [Bn, N, H * D])], [`${name}_bsd`],
      {}, `${name}_to_bsd`));
    return `${name}_bsd`;
  };
  const [qName, kName, vName] = c.names;
  const attrs = { num_heads: { i: Hq } };
  if (c.attrs.scale) attrs.scale = c.attrs.scale;
  let opCausal = 'none';           // what the operator's own causal mask does
  // Sequence lengths go into attention_bias with the causal option and window: the operators'
  // causal masks align to the padded sizes, and GroupQueryAttention's seqlens_k moves the new
  // tokens to the end of each batch element's own length (measured), away from the case's keys.
  const varlen = Boolean(tensors.seqlens_q || tensors.seqlens_k);
  let past = 0;                     // gqa: keys passed as the past
  if (OP === 'mha') {
    if (Hkv !== Hq) throw new Unsupported(`MultiHeadAttention has one kv head per query head (Hq ${Hq}, Hkv ${Hkv})`);
    if (c.attrs.softcap) throw new Unsupported('MultiHeadAttention has no softcap');
    if (!varlen && (causal === 'top_left' || (causal === 'bottom_right' && Nq === Nk))) {
      attrs.unidirectional = { i: 1 };
      opCausal = causal;
    }
  } else {
    if (Dk !== Dv) throw new Unsupported(`GroupQueryAttention needs Dk = Dv (one head_size), got Dk ${Dk}, Dv ${Dv}`);
    if (Nq > Nk) throw new Unsupported(`GroupQueryAttention needs Nq <= Nk (queries are the last tokens), got Nq ${Nq}, Nk ${Nk}`);
    if (Dk % 8 !== 0) throw new Unsupported(`GroupQueryAttention (CPU) needs a head size that is a multiple of 8, got ${Dk}`);
    attrs.kv_num_heads = { i: Hkv };
    if (c.attrs.softcap) attrs.softcap = c.attrs.softcap;
    past = Nk - Nq;
    if (!varlen && (causal === 'bottom_right' || (causal === 'top_left' && Nq === Nk))) opCausal = causal;
    attrs.causal = { i: opCausal === 'none' ? 0 : 1 };
    if (opCausal !== 'none' && window !== 'none') {
      const m = /^(\d+),(\d+)$/.exec(window);
      if (!m) throw new BadCase(`attn.window: ${JSON.stringify(window)} is not "none" or "L,R"`);
      // the operator's window counts the keys a row sees, the diagonal included (measured): L + 1
      if (Number(m[1]) < 2 ** 31 - 1) attrs.local_window_size = { i: Number(m[1]) + 1 };
    }
    if (wantWeights) attrs.qk_output = { i: 2 };
  }
  const windowInOp = 'local_window_size' in attrs;
  const mask = buildMask(tensors, meta, c.dims, inType, {
    causal: opCausal === 'none' ? causal : 'none',
    // with causal, a window "L,R" only adds its left edge
    window: windowInOp ? 'none' : (opCausal !== 'none' && window !== 'none' ? `${window.split(',')[0]},0` : window),
    float: true,
  });
  if (mask) {
    inputs.push(onnx.valueInfo('attention_bias', mask.elem, mask.shape));
    feeds.push({ name: 'attention_bias', type: mask.type, data: mask.data, shape: mask.shape });
  }
  // head_sink [Hq] is of type T: the sinks rounded once, to nearest-even, into the input dtype.
  const sinks = OP === 'gqa' && tensors.sinks ? roundInto(st.values(tensors.sinks), inType) : null;
  if (sinks) {
    inputs.push(onnx.valueInfo('head_sink', c.T.elem, [sinks.length]));
    feeds.push({ name: 'head_sink', type: c.T.name, data: sinks, shape: [sinks.length] });
  }
  const slice = (name, axis, from, to, out) => {
    nodes.push(onnx.node('Slice', [name, int64(`${out}_from`, [from]), int64(`${out}_to`, [to]), int64(`${out}_axis`, [axis])],
      [out], {}, `slice_${out}`));
    return out;
  };
  if (OP === 'mha') {
    const opInputs = [toBSD(qName, B, Hq, Nq, Dk), toBSD(kName, B, Hkv, Nk, Dk), toBSD(vName, B, Hkv, Nk, Dv), '', ''];
    if (mask) opInputs.push('attention_bias');
    while (opInputs[opInputs.length - 1] === '') opInputs.pop();
    nodes.push(onnx.node(opName, opInputs, ['y_bsd'], attrs, 'attention', 'com.microsoft'));
  } else {
    // Several queries with a past need batch 1: then one node per batch element, results concatenated.
    const parts = B > 1 && Nq > 1 && past > 0 ? B : 1;
    const Bn = B / parts;
    initializers.push(onnx.tensor('seqlens_k', onnx.INT32, [Bn], Int32Array.from({ length: Bn }, () => Nk - 1)));
    initializers.push(onnx.tensor('total_sequence_length', onnx.INT32, [], Int32Array.from([Nk])));
    const ys = []; const ws = [];
    for (let b = 0; b < parts; b++) {
      const tag = parts > 1 ? `_b${b}` : '';
      const pick = (name) => (parts > 1 ? slice(name, 0, b, b + 1, `${name}${tag}`) : name);
      const [q, k, v] = [pick(qName), pick(kName), pick(vName)];
      const split = (name, D) => {
        if (past === 0) return [toBSD(name, Bn, Hkv, Nk, D), ''];
        const pastName = slice(name, 2, 0, past, `${name}_past`);
        return [toBSD(slice(name, 2, past, Nk, `${name}_new`), Bn, Hkv, Nq, D), pastName];
      };
      const [kNew, kPast] = split(k, Dk);
      const [vNew, vPast] = split(v, Dv);
      const opInputs = [toBSD(q, Bn, Hq, Nq, Dk), kNew, vNew, kPast, vPast, 'seqlens_k', 'total_sequence_length'];
      opInputs.push('', '', '', mask ? (parts > 1 && mask.shape[0] > 1
        ? slice('attention_bias', 0, b, b + 1, `attention_bias${tag}`) : 'attention_bias') : '');
      if (sinks) opInputs.push('head_sink');
      while (opInputs[opInputs.length - 1] === '') opInputs.pop();
      // without present_key and present_value outputs the CPU kernel ignores the past (measured)
      const opOutputs = [`y_bsd${tag}`, `present_key${tag}`, `present_value${tag}`];
      if (wantWeights) opOutputs.push(`w${tag}`);
      nodes.push(onnx.node(opName, opInputs, opOutputs, attrs, `attention${tag}`, 'com.microsoft'));
      ys.push(`y_bsd${tag}`);
      ws.push(`w${tag}`);
    }
    if (parts > 1) {
      nodes.push(onnx.node('Concat', ys, ['y_bsd'], { axis: { i: 0 } }, 'concat_batches'));
      if (wantWeights) nodes.push(onnx.node('Concat', ws, ['w'], { axis: { i: 0 } }, 'concat_batch_weights'));
    }
  }

  let outName; let outShape;
  if (kind === 'sdpa') {
    nodes.push(onnx.node('Reshape', ['y_bsd', int64('y_bshd_shape', [B, Nq, Hq, Dv])], ['y_bshd'], {}, 'split_heads'));
    nodes.push(onnx.node('Transpose', ['y_bshd'], ['y'], { perm: { ints: [0, 2, 1, 3] } }, 'heads_outer'));
    [outName, outShape] = ['y', [B, Hq, Nq, Dv]];
  } else {
    nodes.push(onnx.node('MatMul', ['y_bsd', 'w_o'], ['y'], {}, 'project_out'));
    [outName, outShape] = ['y', [B, Nq, tensors.w_o.shape[1]]];
  }
  const { outputs, results, finish } = graphOutputs(nodes, inType, types);
  finish(outName, outShape, 'out');
  if (OP === 'gqa' && wantWeights) finish('w', c.dims, 'weights');
  const model = onnx.model({ nodes, inputs, outputs, initializers }, { contrib: true });
  return { model, feeds, results };
}

// ---- running --------------------------------------------------------------------------------

const sessions = new Map();         // model bytes (latin1 string) -> InferenceSession
const MAX_SESSIONS = 32;

async function session(ort, model, options) {
  const key = Buffer.from(model).toString('latin1');
  let s = sessions.get(key);
  if (s) return s;
  s = await ort.InferenceSession.create(model, options);
  if (sessions.size >= MAX_SESSIONS) {
    const [oldKey, old] = sessions.entries().next().value;
    sessions.delete(oldKey);
    await old.release();
  }
  sessions.set(key, s);
  return s;
}

async function runCase(ort, input, options) {
  let tensors; let metadata;
  try {
    ({ tensors, metadata } = st.read(input));
  } catch (e) {
    if (e instanceof st.UnsupportedDtype) throw new Unsupported(e.message);
    throw e;
  }
  const p = plan(tensors, metadata);
  const s = await session(ort, p.model, options);
  const feeds = {};
  for (const f of p.feeds) feeds[f.name] = new ort.Tensor(f.type, f.data, f.shape);
  const got = await s.run(feeds);
  const out = {};
  for (const r of p.results) {
    const t = got[r.ort];
    let data = t.data;
    if (r.dtype === 'F16' && !(data instanceof Uint16Array)) {       // a Float16Array: its bits
      data = new Uint16Array(data.buffer, data.byteOffset, data.length);
    }
    out[r.name] = { dtype: r.dtype, shape: Array.from(t.dims), data };
  }
  return out;
}

function writeText(file, text) {
  const tmp = `${file}.tmp${process.pid}`;
  fs.writeFileSync(tmp, `${String(text).replace(/\n+$/, '')}\n`, 'utf8');
  fs.renameSync(tmp, file);
}

async function runJob(ort, job, options) {
  const output = job.output;
  try {
    const tensors = await runCase(ort, job.input, options);
    st.write(output, tensors, {});
  } catch (e) {
    if (e instanceof Unsupported) writeText(`${output}.unsupported`, e.message);
    else if (e instanceof BadCase) writeText(`${output}.error`, e.message);
    else writeText(`${output}.error`, `${e && e.name ? e.name : 'Error'}: ${e && e.message ? e.message : e}`);
  }
}

const USAGE = `usage: node adapter.js [--op attention|mha|gqa] [--threads N] [--f64] JOBS.jsonl
  --op OP      attention: ONNX Attention (default); mha: com.microsoft.MultiHeadAttention;
               gqa: com.microsoft.GroupQueryAttention
  --threads N  ONNX Runtime intra-op threads (default: its own choice)
  --f64        run F64 cases too, through the operator's ONNX function body (no kernel for double)
`;

function usage(message) {
  process.stderr.write(`adapter.js: ${message}\n${USAGE}`);
  process.exit(2);
}

async function main(argv) {
  let jobsFile = null;
  let threads = 0;
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--threads') {
      threads = Number(argv[++i]);
      if (!Number.isInteger(threads) || threads < 0) usage('--threads needs an integer >= 0');
    } else if (argv[i] === '--op') {
      OP = argv[++i];
      if (!OPS.includes(OP)) usage(`--op must be one of ${OPS.join(', ')}`);
    } else if (argv[i] === '--f64') {
      ORT_TYPES = { F64: F64_TYPE, ...KERNEL_TYPES };
    } else if (argv[i] === '-h' || argv[i] === '--help') {
      process.stdout.write(USAGE);
      return 0;
    } else if (jobsFile === null) jobsFile = argv[i];
    else usage(`unexpected argument ${argv[i]}`);
  }
  if (jobsFile === null) usage('a jobs file is required');
  if (OP !== 'attention' && 'F64' in ORT_TYPES) usage('--f64 is for --op attention only (the contrib operators have no double kernel)');

  let ort;
  try {
    ort = require('onnxruntime-node');
  } catch (e) {
    process.stderr.write(`adapter.js: cannot load onnxruntime-node (${e.message.split('\n')[0]}); `
      + `run \`npm ci --ignore-scripts\` in ${__dirname}\n`);
    return 2;
  }
  const options = { logSeverityLevel: 3 };
  if (threads > 0) options.intraOpNumThreads = threads;

  const lines = fs.readFileSync(jobsFile, 'utf8').split('\n');
  for (const line of lines) {
    if (!line.trim()) continue;
    let job;
    try {
      job = JSON.parse(line);
    } catch (e) {
      process.stderr.write(`adapter.js: skipping a jobs line that is not JSON: ${e.message}\n`);
      continue;
    }
    try {
      await runJob(ort, job, options);
    } catch (e) {           // cannot even write the .error file: say so, go on
      process.stderr.write(`adapter.js: job ${job.id}: ${e.message}\n`);
    }
  }
  for (const s of sessions.values()) await s.release();
  return 0;
}

if (require.main === module) {
  main(process.argv.slice(2)).then((code) => { process.exitCode = code; }, (e) => {
    process.stderr.write(`adapter.js: ${e.stack || e}\n`);
    process.exitCode = 2;
  });
}

module.exports = { plan, buildMask, parseExact, textToFloat32, rationalToFloat32 };
