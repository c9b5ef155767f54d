// Tests of the ONNX Runtime adapter, its safetensors reader/writer and its ONNX encoder.
//
//   node --test conformance/adapters/onnxruntime/test_adapter.mjs
//
// Each adapter test writes small case files, runs adapter.js on a jobs file as the runner would,
// and checks hand-worked results. With the reference binary (ATTNORACLE_CLI, or build/attnoracle
// or build/tools/attnoracle in the repository) random F32 cases are also compared with `eval`.
// Without node_modules/onnxruntime-node (`npm ci --ignore-scripts` here) the tests that need
// ONNX Runtime are skipped and say why.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync, execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const require = createRequire(import.meta.url);
const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO = path.resolve(HERE, '..', '..', '..');
const ADAPTER = path.join(HERE, 'adapter.js');
const st = require('./safetensors.js');
const onnx = require('./onnx_model.js');

const HAVE_ORT = fs.existsSync(path.join(HERE, 'node_modules', 'onnxruntime-node', 'package.json'));
const NO_ORT = HAVE_ORT ? false
  : `node_modules/onnxruntime-node is missing: run \`npm ci --ignore-scripts\` in ${HERE}`;
if (NO_ORT) console.log(`# skipping the ONNX Runtime tests: ${NO_ORT}`);

function findCli() {
  const candidates = [process.env.ATTNORACLE_CLI || '', path.join(REPO, 'build', 'attnoracle'),
    path.join(REPO, 'build', 'tools', 'attnoracle')];
  return candidates.find((c) => {
    if (!c) return false;
    try { fs.accessSync(c, fs.constants.X_OK); return fs.statSync(c).isFile(); } catch { return false; }
  }) || null;
}

// ---- helpers --------------------------------------------------------------------------------

const T = (dtype, shape, data) => ({ dtype, shape, data });
const meta = (keys = {}) => {
  const m = { 'attn.format': '1' };
  for (const [k, v] of Object.entries(keys)) m[`attn.${k}`] = String(v);
  return m;
};

class Workspace {
  constructor() {
    this.dir = fs.mkdtempSync(path.join(os.tmpdir(), 'attn_ort_'));
    this.n = 0;
  }

  close() { fs.rmSync(this.dir, { recursive: true, force: true }); }

  /** Writes a case file; returns its path. */
  case(tensors, metadata) {
    this.n += 1;
    const p = path.join(this.dir, `case${this.n}.safetensors`);
    st.write(p, tensors, metadata);
    return p;
  }

  /**
   * Runs the adapter on case paths; one result per case: {kind: 'ok', tensors} |
   * {kind: 'error' | 'unsupported', text}. Checks exit 0, exactly one output each, no temp files.
   */
  run(cases, flags = []) {
    this.n += 1;
    const jobs = path.join(this.dir, `jobs${this.n}.jsonl`);
    const outputs = cases.map((_, i) => path.join(this.dir, `out${this.n}_${i}.safetensors`));
    fs.writeFileSync(jobs, cases.map((c, i) => `${JSON.stringify({ id: `c${i}`, input: c, output: outputs[i] })}\n`).join(''));
    const p = spawnSync(process.execPath, [ADAPTER, ...flags, jobs], { encoding: 'utf8' });
    assert.equal(p.status, 0, p.stderr);
    const results = outputs.map((o) => {
      const found = ['', '.error', '.unsupported'].filter((s) => fs.existsSync(o + s));
      assert.equal(found.length, 1, `${o}: expected exactly one output, found [${found}]`);
      if (found[0] === '') return { kind: 'ok', tensors: st.read(o).tensors };
      return { kind: found[0].slice(1), text: fs.readFileSync(o + found[0], 'utf8') };
    });
    assert.deepEqual(fs.readdirSync(this.dir).filter((f) => f.includes('.tmp')), [], 'temporary files left behind');
    return results;
  }

  /** Runs one case and returns its tensors as {name: {dtype, shape, v: [values]}}. */
  one(tensors, metadata, flags = []) {
    const [r] = this.run([this.case(tensors, metadata)], flags);
    assert.equal(r.kind, 'ok', r.text);
    const out = {};
    for (const [k, t] of Object.entries(r.tensors)) out[k] = { dtype: t.dtype, shape: t.shape, v: Array.from(st.values(t)) };
    return out;
  }
}

function close(actual, expected, tol, what = '') {
  assert.equal(actual.length, expected.length, `${what}: length`);
  for (let i = 0; i < expected.length; i++) {
    const ok = Number.isNaN(expected[i]) ? Number.isNaN(actual[i]) : Math.abs(actual[i] - expected[i]) <= tol;
    assert.ok(ok, `${what}[${i}]: got ${actual[i]}, expected ${expected[i]} (tolerance ${tol})`);
  }
}

function softmax(s) {
  const m = Math.max(...s);
  const e = s.map((x) => Math.exp(x - m));
  const z = e.reduce((a, b) => a + b, 0);
  return e.map((x) => x / z);
}

function ortTest(name, fn) {
  test(name, { skip: NO_ORT }, async () => {
    const w = new Workspace();
    try { await fn(w); } finally { w.close(); }
  });
}

// ---- safetensors.js and onnx_model.js (no ONNX Runtime needed) ------------------------------

test('F16 conversion: bit patterns, ties to even, subnormals, overflow', () => {
  const cases = [[1, 0x3c00], [-2, 0xc000], [65504, 0x7bff], [65520, 0x7c00], [65519.99, 0x7bff],
    [2 ** -24, 0x0001], [2 ** -25, 0x0000], [3 * 2 ** -25, 0x0002], [2 ** -14, 0x0400],
    [1 + 2 ** -11, 0x3c00], [1 + 3 * 2 ** -11, 0x3c02], [1 + 2 ** -11 + 2 ** -40, 0x3c01],
    [-0, 0x8000], [Infinity, 0x7c00], [-Infinity, 0xfc00], [0.1, 0x2e66], [1 / 3, 0x3555]];
  for (const [x, bits] of cases) {
    assert.equal(st.numberToHalf(x), bits, `numberToHalf(${x})`);
    if (Number.isFinite(st.halfToNumber(bits)) && bits !== 0x7bff) {
      assert.equal(st.numberToHalf(st.halfToNumber(bits)), bits, `round trip ${bits.toString(16)}`);
    }
  }
  assert.ok(Number.isNaN(st.halfToNumber(st.numberToHalf(NaN))));
  for (let b = 0; b < 0x7c00; b += 7) assert.equal(st.numberToHalf(st.halfToNumber(b)), b);
});

test('BF16 conversion: directly from the double, no double rounding', () => {
  assert.equal(st.numberToBf16(1), 0x3f80);
  assert.equal(st.numberToBf16(1 + 2 ** -8), 0x3f80);                 // tie -> even
  assert.equal(st.numberToBf16(1 + 3 * 2 ** -8), 0x3f82);
  assert.equal(st.numberToBf16(1 + 2 ** -8 + 2 ** -30), 0x3f81);      // through float32 this would tie
  assert.equal(st.numberToBf16(-Infinity), 0xff80);
  assert.equal(st.numberToBf16(2 ** -133), 0x0001);
  assert.equal(st.bf16ToNumber(0x4049), 3.140625);
});

test('safetensors write/read round trip of every dtype, header padded to 8', () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'attn_ort_st_'));
  try {
    const p = path.join(dir, 'a.safetensors');
    st.write(p, {
      f64: T('F64', [2], [0.1, -3]), f32: T('F32', [1, 2], [0.1, 2]), f16: T('F16', [3], [1, 0.1, -2]),
      bf: T('BF16', [2], [3.140625, -1]), b: T('BOOL', [3], [1, 0, 1]), i: T('I64', [2], [5, -7]),
    }, { 'attn.format': '1' });
    const raw = fs.readFileSync(p);
    assert.equal(Number(raw.readBigUInt64LE(0)) % 8, 0);
    const { tensors, metadata } = st.read(p);
    assert.deepEqual(metadata, { 'attn.format': '1' });
    assert.deepEqual(Array.from(st.values(tensors.f64)), [0.1, -3]);
    assert.deepEqual(Array.from(st.values(tensors.f32)), [Math.fround(0.1), 2]);
    assert.deepEqual(Array.from(tensors.f16.data), [0x3c00, 0x2e66, 0xc000]);
    assert.deepEqual(Array.from(st.values(tensors.bf)), [3.140625, -1]);
    assert.deepEqual(Array.from(tensors.b.data), [1, 0, 1]);
    assert.deepEqual(Array.from(tensors.i.data), [5n, -7n]);
    assert.deepEqual(tensors.f32.shape, [1, 2]);
    assert.deepEqual(Object.keys(JSON.parse(raw.subarray(8, 8 + Number(raw.readBigUInt64LE(0))))),
      ['b', 'bf', 'f16', 'f32', 'f64', 'i', '__metadata__']);
    assert.throws(() => st.write(path.join(dir, 'x.safetensors'), { x: T('F8_E4M3', [1], [0]) }, {}),
      st.UnsupportedDtype);
    const header = Buffer.from('{"x":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}}');
    const len = Buffer.alloc(8);
    len.writeBigUInt64LE(BigInt(header.length));
    fs.writeFileSync(path.join(dir, 'f8.safetensors'), Buffer.concat([len, header, Buffer.from([0])]));
    assert.throws(() => st.read(path.join(dir, 'f8.safetensors')), st.UnsupportedDtype);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test('protobuf varints and a minimal ModelProto', () => {
  assert.deepEqual(Array.from(onnx.varint(0)), [0]);
  assert.deepEqual(Array.from(onnx.varint(300)), [0xac, 0x02]);
  assert.equal(onnx.varint(-1).length, 10);
  const m = onnx.model({ nodes: [], inputs: [], outputs: [] });
  assert.deepEqual(Array.from(m.subarray(0, 2)), [0x08, 10]);        // ir_version = 10
  const tail = Array.from(m.subarray(m.length - 6));
  assert.deepEqual(tail, [0x42, 4, 0x0a, 0, 0x10, 23]);               // opset_import {"" 23}
});

test('number texts are rounded once to float32', () => {
  const a = require('./adapter.js');
  assert.equal(a.textToFloat32('0x1.6a09e667f3bcdp-3', 'x'), Math.fround(Math.SQRT1_2 / 4));
  assert.equal(a.textToFloat32('0.1', 'x'), Math.fround(0.1));
  assert.equal(a.textToFloat32('0x1p-150', 'x'), 0);                  // tie -> even (zero)
  assert.equal(a.textToFloat32('0x1.8p-149', 'x'), 2 ** -148);
  assert.equal(a.textToFloat32('1e39', 'x'), Infinity);
  // 1 + 2^-24 + 2^-60: through a double it would be a tie rounding to 1; exactly, it rounds up.
  assert.equal(a.textToFloat32('0x1.000001000000001p0', 'x'), 1 + 2 ** -23);
  assert.throws(() => a.textToFloat32('abc', 'x'));
});

// ---- the adapter, hand-worked cases ---------------------------------------------------------

ortTest('one key gives its value vector (F32 and F16)', (w) => {
  for (const dt of ['F32', 'F16']) {
    const r = w.one({ q: T(dt, [1, 1, 2, 2], [1, 2, -3, 0.5]), k: T(dt, [1, 1, 1, 2], [0.25, 1]),
      v: T(dt, [1, 1, 1, 3], [1.5, -2, 7]) }, meta());
    assert.equal(r.out.dtype, dt);
    assert.deepEqual(r.out.shape, [1, 1, 2, 3]);
    assert.deepEqual(r.out.v, [1.5, -2, 7, 1.5, -2, 7]);
  }
});

ortTest('equal scores give the mean of the values', (w) => {
  for (const dt of ['F32', 'F16']) {
    const r = w.one({ q: T(dt, [1, 1, 1, 2], [0.3, -1]), k: T(dt, [1, 1, 4, 2], [1, 2, 1, 2, 1, 2, 1, 2]),
      v: T(dt, [1, 1, 4, 1], [1, 2, 4, 9]) }, meta({ outputs: 'out,weights' }));
    close(r.out.v, [4], dt === 'F32' ? 1e-6 : 4e-3, dt);
    close(r.weights.v, [0.25, 0.25, 0.25, 0.25], 1e-7, dt);
  }
});

ortTest('causal, both alignments, Nq != Nk', (w) => {
  const zeros = (n) => Array(n).fill(0);
  const v = [1, 2, 4, 8];
  // Nq = 2 < Nk = 4, equal scores: top_left row i sees keys 0..i; bottom_right sees 0..i+2.
  const base = { q: T('F32', [1, 1, 2, 1], zeros(2)), k: T('F32', [1, 1, 4, 1], zeros(4)), v: T('F32', [1, 1, 4, 1], v) };
  close(w.one(base, meta({ causal: 'top_left' })).out.v, [1, 1.5], 1e-6, 'top_left');
  close(w.one(base, meta({ causal: 'bottom_right' })).out.v, [7 / 3, 15 / 4], 1e-6, 'bottom_right');
  // Nq = 3 > Nk = 2: bottom_right row 0 allows j <= -1, a fully masked row: zeros.
  const tall = { q: T('F32', [1, 1, 3, 1], zeros(3)), k: T('F32', [1, 1, 2, 1], zeros(2)), v: T('F32', [1, 1, 2, 1], [2, 6]) };
  close(w.one(tall, meta({ causal: 'top_left' })).out.v, [2, 4, 4], 1e-6, 'top_left tall');
  close(w.one(tall, meta({ causal: 'bottom_right', masked_rows: 'zero' })).out.v, [0, 2, 4], 1e-6, 'bottom_right tall');
});

ortTest('window, aligned like the causal option', (w) => {
  const base = { q: T('F32', [1, 1, 2, 1], [0, 0]), k: T('F32', [1, 1, 4, 1], [0, 0, 0, 0]), v: T('F32', [1, 1, 4, 1], [1, 2, 4, 8]) };
  // top_left, window 1,1: row 0 keys 0..1, row 1 keys 0..2.
  close(w.one(base, meta({ window: '1,1' })).out.v, [1.5, 7 / 3], 1e-6, 'window');
  // bottom_right (i' = i + 2) with window 1,0: row 0 keys 1..2, row 1 keys 2..3.
  close(w.one(base, meta({ window: '1,0', causal: 'bottom_right' })).out.v, [3, 6], 1e-6, 'window br');
});

ortTest('seqlens: keys past seqlens_k masked, bottom_right aligned per batch', (w) => {
  // Batch 0: Lq = 1, Lk = 3 of Nq = 2, Nk = 4; batch 1 full. Equal scores: the mean of the
  // allowed values. bottom_right: batch 0 query 0 sees keys 0..2 (not 0..2 + 1 from Nk - Nq).
  const zeros = (n) => Array(n).fill(0);
  const base = { q: T('F32', [2, 1, 2, 1], zeros(4)), k: T('F32', [2, 1, 4, 1], zeros(8)),
    v: T('F32', [2, 1, 4, 1], [1, 2, 4, 8, 1, 2, 4, 8]),
    seqlens_q: T('I64', [2], [1, 2]), seqlens_k: T('I64', [2], [3, 4]) };
  const r = w.one(base, meta({ causal: 'bottom_right' })).out.v;
  close([r[0], r[2], r[3]], [7 / 3, 7 / 3, 15 / 4], 1e-6, 'bottom_right per batch');
  close(w.one(base, meta()).out.v.slice(0, 2), [7 / 3, 7 / 3], 1e-6, 'seqlens_k alone');
  // I32 lengths read alike
  const i32 = { ...base, seqlens_q: T('I32', [2], [1, 2]), seqlens_k: T('I32', [2], [3, 4]) };
  close(w.one(i32, meta({ causal: 'bottom_right' })).out.v, r, 1e-7, 'I32');
  // a batch element with no key (seqlens_k 0): its rows are fully masked, zeros
  const empty = { ...base, seqlens_q: T('I64', [2], [2, 2]), seqlens_k: T('I64', [2], [0, 4]) };
  close(w.one(empty, meta({ masked_rows: 'zero' })).out.v, [0, 0, 15 / 4, 15 / 4], 1e-6, 'seqlens_k 0');
});

test('paged KV caches and empty shapes are unsupported, naming them', () => {
  const a = require('./adapter.js');
  const zeros = (n) => new Float32Array(n);
  const paged = { q: T('F32', [1, 1, 1, 2], zeros(2)), k_cache: T('F32', [2, 2, 1, 2], zeros(8)),
    v_cache: T('F32', [2, 2, 1, 2], zeros(8)), block_table: T('I32', [1, 2], Int32Array.from([1, 0])),
    seqlens_k: T('I32', [1], Int32Array.from([3])) };
  assert.throws(() => a.plan(paged, meta({})), /paged KV cache \(k_cache, v_cache, block_table\)/);
  const empty = { q: T('F32', [1, 1, 1, 2], zeros(2)), k: T('F32', [1, 1, 0, 2], zeros(0)), v: T('F32', [1, 1, 0, 2], zeros(0)) };
  assert.throws(() => a.plan(empty, meta({ masked_rows: 'zero' })), /empty shape: k is \[1,1,0,2\]/);
});

test('seqlens_k becomes nonpad_kv_seqlen (opset 24); the mask keeps only the rest', () => {
  const a = require('./adapter.js');
  const zeros = (n) => new Float32Array(n);
  const t = { q: T('F32', [2, 1, 2, 1], zeros(4)), k: T('F32', [2, 1, 4, 1], zeros(8)), v: T('F32', [2, 1, 4, 1], zeros(8)),
    seqlens_q: T('I64', [2], BigInt64Array.from([1n, 2n])), seqlens_k: T('I64', [2], BigInt64Array.from([3n, 4n])) };
  const feeds = (m, tensors = t) => Object.fromEntries(a.plan({ ...tensors }, meta(m)).feeds.map((f) => [f.name, f]));
  const alone = feeds({});
  assert.deepEqual(Object.keys(alone).sort(), ['k', 'nonpad_kv_seqlen', 'q', 'v']);
  assert.deepEqual(Array.from(alone.nonpad_kv_seqlen.data), [3n, 4n]);
  assert.equal(alone.nonpad_kv_seqlen.type, 'int64');
  // bottom_right per batch: the mask [B,1,Nq,Nk] has the causal part only, keys past Lk allowed
  const br = feeds({ causal: 'bottom_right' });
  assert.deepEqual(br.attn_mask.shape, [2, 1, 2, 4]);
  assert.deepEqual(Array.from(br.attn_mask.data), [1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]);
  assert.deepEqual(Array.from(a.plan({ ...t }, meta()).model.slice(-6)), [0x42, 4, 0x0a, 0, 0x10, 24]);  // opset {"" 24}
  const { seqlens_k: _k, ...noLengths } = t;
  assert.deepEqual(Array.from(a.plan({ ...noLengths }, meta()).model.slice(-6)), [0x42, 4, 0x0a, 0, 0x10, 23]);
  const i32 = feeds({}, { ...t, seqlens_k: T('I32', [2], Int32Array.from([3, 4])) });
  assert.deepEqual(Array.from(i32.nonpad_kv_seqlen.data), [3n, 4n]);
  // without seqlens_k: no nonpad_kv_seqlen, lengths of seqlens_q only shift the causal mask
  const qOnly = feeds({ causal: 'bottom_right' }, noLengths);
  assert.equal(qOnly.nonpad_kv_seqlen, undefined);
  assert.deepEqual(qOnly.attn_mask.shape, [2, 1, 2, 4]);
});

ortTest('GQA and MQA: query head h reads kv head h / (Hq / Hkv)', (w) => {
  const ones = (n) => Array(n).fill(1);
  const r = w.one({ q: T('F32', [1, 6, 1, 1], ones(6)), k: T('F32', [1, 3, 1, 1], ones(3)),
    v: T('F32', [1, 3, 1, 1], [10, 20, 30]) }, meta());
  assert.deepEqual(r.out.v, [10, 10, 20, 20, 30, 30]);
  const m = w.one({ q: T('F32', [2, 4, 1, 1], ones(8)), k: T('F32', [2, 1, 1, 1], [1, 1]),
    v: T('F32', [2, 1, 1, 1], [5, 7]) }, meta());
  assert.deepEqual(m.out.v, [5, 5, 5, 5, 7, 7, 7, 7]);
});

ortTest('scale (hex float), softcap before bias', (w) => {
  // q = 1, k = [1, 2, 3]: T = scale * [1, 2, 3]; scale 0.5 = 0x1p-1.
  const base = { q: T('F32', [1, 1, 1, 1], [1]), k: T('F32', [1, 1, 3, 1], [1, 2, 3]), v: T('F32', [1, 1, 3, 1], [1, 2, 3]) };
  let r = w.one(base, meta({ scale: '0x1p-1', outputs: 'out,weights' }));
  close(r.weights.v, softmax([0.5, 1, 1.5]), 1e-7, 'scale');
  // softcap 1, bias [0, 1, 0]: S = tanh(T) + bias (bias after the cap).
  r = w.one({ ...base, bias: T('F32', [3], [0, 1, 0]) }, meta({ scale: '1', softcap: '1', outputs: 'out,weights' }));
  const wts = softmax([Math.tanh(1), Math.tanh(2) + 1, Math.tanh(3)]);
  close(r.weights.v, wts, 1e-6, 'softcap then bias');
  close(r.out.v, [wts[0] + 2 * wts[1] + 3 * wts[2]], 1e-6, 'softcap out');
});

ortTest('bias: finite values shift scores, -inf masks the key; mask broadcast', (w) => {
  const base = { q: T('F32', [1, 2, 2, 1], [0, 0, 0, 0]), k: T('F32', [1, 2, 3, 1], [0, 0, 0, 0, 0, 0]),
    v: T('F32', [1, 2, 3, 1], [1, 2, 3, 10, 20, 30]) };
  // bias [Nq, Nk] broadcast over heads; row 0: [0, -inf, ln 2] -> weights 1/3, 0, 2/3.
  const r = w.one({ ...base, bias: T('F64', [2, 3], [0, -Infinity, Math.log(2), 0, 0, -Infinity]) },
    meta({ outputs: 'out,weights' }));
  close(r.out.v, [7 / 3, 1.5, 70 / 3, 15], 1e-5, 'bias');
  close(r.weights.v.slice(0, 3), [1 / 3, 0, 2 / 3], 1e-7, 'bias weights');
  // A boolean mask [B=1, H=2, 1, Nk] (Nq broadcast needs a full [Nq, Nk] trailing pair: [2, 3]).
  const m = w.one({ ...base, mask: T('BOOL', [2, 2, 3], [1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 1, 1]) }, meta());
  close(m.out.v, [1.5, 1.5, 25, 25], 1e-5, 'mask');
  // A padding row (query_mask false) is computed like any other.
  const pad = w.one({ ...base, mask: T('BOOL', [2, 2, 3], [1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 1, 1]),
    query_mask: T('BOOL', [1, 2], [1, 0]) }, meta());
  assert.deepEqual(pad.out.v, m.out.v);
});

ortTest('fully masked rows give zeros (bool mask, -inf bias), F32 and F16, both policies', (w) => {
  for (const dt of ['F32', 'F16']) {
    for (const policy of ['error', 'zero']) {
      const base = { q: T(dt, [1, 1, 2, 1], [1, 1]), k: T(dt, [1, 1, 2, 1], [1, 2]), v: T(dt, [1, 1, 2, 2], [1, 2, 3, 4]) };
      const viaMask = w.one({ ...base, mask: T('BOOL', [2, 2], [1, 1, 0, 0]) },
        meta({ masked_rows: policy, outputs: 'out,weights' }));
      const e = softmax([1, 2]);                  // Dk = 1: scale 1
      close(viaMask.out.v, [e[0] + 3 * e[1], 2 * e[0] + 4 * e[1], 0, 0], dt === 'F32' ? 1e-5 : 1e-2, `${dt} mask`);
      assert.deepEqual(viaMask.weights.v.slice(2), [0, 0]);
      const viaBias = w.one({ ...base, bias: T('F32', [2, 2], [0, 0.5, -Infinity, -Infinity]) },
        meta({ masked_rows: policy, outputs: 'out,weights' }));
      assert.deepEqual(viaBias.out.v.slice(2), [0, 0]);
      assert.deepEqual(viaBias.weights.v.slice(2), [0, 0]);
      assert.ok(viaBias.out.v.every(Number.isFinite));
    }
  }
});

ortTest('mha: projections per head, heads concatenated (head 0 first), W_o', (w) => {
  // B=1, N=2, D=2, H=2, Dk=1, Dv=1. W_q = W_k = 0: equal scores -> each head averages its V.
  // V_r = X w_v[r]: x rows [1,0], [0,1]; w_v[0] = [1,3] -> V_0 = [1,3]; w_v[1] = [2,6] -> V_1 = [2,6].
  // Head means: 2 and 4; concat [2, 4] @ W_o [[1, 0], [10, 1]] = [42, 4] for both rows.
  const x = T('F32', [1, 2, 2], [1, 0, 0, 1]);
  const r = w.one({ x_q: x, x_kv: x, w_q: T('F32', [2, 2, 1], [0, 0, 0, 0]), w_k: T('F32', [2, 2, 1], [0, 0, 0, 0]),
    w_v: T('F32', [2, 2, 1], [1, 3, 2, 6]), w_o: T('F32', [2, 2], [1, 0, 10, 1]) },
  meta({ kind: 'mha', outputs: 'out,weights' }));
  assert.deepEqual(r.out.shape, [1, 2, 2]);
  close(r.out.v, [42, 4, 42, 4], 1e-5, 'mha');
  assert.deepEqual(r.weights.shape, [1, 2, 2, 2]);
  // Causal mha: row 0 sees key 0 only -> heads [1, 2] -> [21, 2].
  const c = w.one({ x_q: x, x_kv: x, w_q: T('F32', [2, 2, 1], [0, 0, 0, 0]), w_k: T('F32', [2, 2, 1], [0, 0, 0, 0]),
    w_v: T('F32', [2, 2, 1], [1, 3, 2, 6]), w_o: T('F32', [2, 2], [1, 0, 10, 1]) }, meta({ kind: 'mha', causal: 'top_left' }));
  close(c.out.v, [21, 2, 42, 4], 1e-5, 'mha causal');
});

ortTest('output dtypes: F32 -> F16 and F16 -> F32 through a Cast node', (w) => {
  const base = (dt) => ({ q: T(dt, [1, 1, 1, 1], [0]), k: T(dt, [1, 1, 3, 1], [0, 0, 0]), v: T(dt, [1, 1, 3, 1], [0.1, 0.2, 0.4]) });
  const a = w.one(base('F32'), meta({ output_dtype: 'F16', outputs: 'out,weights' }));
  assert.equal(a.out.dtype, 'F16');
  assert.equal(a.weights.dtype, 'F16');
  close(a.out.v, [0.7 / 3], 2 ** -12, 'F32->F16');
  const b = w.one(base('F16'), meta({ output_dtype: 'F32' }));
  assert.equal(b.out.dtype, 'F32');
  close(b.out.v, [0.7 / 3], 2 ** -10, 'F16->F32');
});

ortTest('attn.output_dtypes: each output cast to its own dtype, or unsupported naming it', (w) => {
  const base = { q: T('F32', [1, 1, 1, 1], [0]), k: T('F32', [1, 1, 3, 1], [0, 0, 0]), v: T('F32', [1, 1, 3, 1], [0.1, 0.2, 0.4]) };
  const a = w.one(base, meta({ outputs: 'out,weights,lse', output_dtypes: 'weights:F16,lse:F32' }));
  assert.equal(a.out.dtype, 'F32');
  assert.equal(a.weights.dtype, 'F16');
  close(a.weights.v, [1 / 3, 1 / 3, 1 / 3], 2 ** -12, 'weights in F16');
  const b = w.one(base, meta({ output_dtype: 'F16', output_dtypes: 'out:F32' }));
  assert.equal(b.out.dtype, 'F32');
  close(b.out.v, [0.7 / 3], 1e-7, 'out in F32');
  const res = w.run([w.case(base, meta({ outputs: 'out,weights', output_dtypes: 'weights:BF16' }))]);
  assert.equal(res[0].kind, 'unsupported');
  assert.match(res[0].text, /attn\.output_dtypes: weights in BF16/);
});

ortTest('weights are returned when asked, lse is not written', (w) => {
  const r = w.one({ q: T('F32', [1, 1, 1, 1], [1]), k: T('F32', [1, 1, 2, 1], [0, 1]), v: T('F32', [1, 1, 2, 1], [0, 1]) },
    meta({ outputs: 'out,weights,lse', scale: '1' }));
  assert.deepEqual(Object.keys(r).sort(), ['out', 'weights']);
  close(r.weights.v, softmax([0, 1]), 1e-7, 'weights');
  const o = w.one({ q: T('F32', [1, 1, 1, 1], [1]), k: T('F32', [1, 1, 2, 1], [0, 1]), v: T('F32', [1, 1, 2, 1], [0, 1]) }, meta());
  assert.deepEqual(Object.keys(o), ['out']);
});

ortTest('protocol: unsupported dtypes and keys, a bad job among good ones', (w) => {
  const good = w.case({ q: T('F32', [1, 1, 1, 1], [0]), k: T('F32', [1, 1, 1, 1], [0]), v: T('F32', [1, 1, 1, 1], [3]) }, meta());
  const bf16 = w.case({ q: T('BF16', [1, 1, 1, 1], [0]), k: T('BF16', [1, 1, 1, 1], [0]), v: T('BF16', [1, 1, 1, 1], [3]) }, meta());
  const f64 = w.case({ q: T('F64', [1, 1, 1, 1], [0]), k: T('F64', [1, 1, 1, 1], [0]), v: T('F64', [1, 1, 1, 1], [3]) }, meta());
  const key = w.case({ q: T('F32', [1, 1, 1, 1], [0]), k: T('F32', [1, 1, 1, 1], [0]), v: T('F32', [1, 1, 1, 1], [3]) },
    { ...meta(), 'attn.unknown': 'x' });
  const outBf16 = w.case({ q: T('F32', [1, 1, 1, 1], [0]), k: T('F32', [1, 1, 1, 1], [0]), v: T('F32', [1, 1, 1, 1], [3]) },
    meta({ output_dtype: 'BF16' }));
  const missing = w.case({ q: T('F32', [1, 1, 1, 1], [0]) }, meta());
  const garbage = path.join(w.dir, 'garbage.safetensors');
  fs.writeFileSync(garbage, 'not a safetensors file');
  const res = w.run([good, bf16, f64, key, outBf16, missing, garbage, path.join(w.dir, 'absent.safetensors'), good]);
  assert.deepEqual(res.map((r) => r.kind),
    ['ok', 'unsupported', 'unsupported', 'unsupported', 'unsupported', 'error', 'error', 'error', 'ok']);
  assert.match(res[1].text, /BF16/);
  assert.match(res[2].text, /F64/);
  assert.match(res[3].text, /attn\.unknown/);
  assert.match(res[4].text, /BF16/);
  assert.match(res[5].text, /tensor k is missing/);
  assert.deepEqual(Array.from(st.values(res[8].tensors.out)), [3]);
});

ortTest('--f64: the function-body fallback in double (fully masked rows NaN, as documented)', (w) => {
  const base = { q: T('F64', [1, 1, 2, 1], [1, 1]), k: T('F64', [1, 1, 2, 1], [0, 1]), v: T('F64', [1, 1, 2, 1], [0, 1]) };
  const r = w.one({ ...base, mask: T('BOOL', [2, 2], [1, 1, 0, 0]) }, meta({ scale: '0.25', masked_rows: 'zero' }), ['--f64']);
  assert.equal(r.out.dtype, 'F64');
  close([r.out.v[0]], [softmax([0, 0.25])[1]], 1e-15, 'f64 out');
  assert.ok(Number.isNaN(r.out.v[1]), `fully masked row: ${r.out.v[1]}`);
});

ortTest('ONNX Runtime itself: is_causal with Nq != Nk and no past is aligned top-left', async () => {
  const ort = require('onnxruntime-node');
  const dims = { q: [1, 1, 2, 1], k: [1, 1, 3, 1], v: [1, 1, 3, 1] };
  const bytes = onnx.model({
    nodes: [onnx.node('Attention', ['q', 'k', 'v'], ['y'], { is_causal: { i: 1 } })],
    inputs: Object.entries(dims).map(([n, d]) => onnx.valueInfo(n, onnx.FLOAT, d)),
    outputs: [onnx.valueInfo('y', onnx.FLOAT, [1, 1, 2, 1])],
  });
  const s = await ort.InferenceSession.create(bytes, { logSeverityLevel: 3 });
  const r = await s.run({ q: new ort.Tensor('float32', new Float32Array(2), dims.q),
    k: new ort.Tensor('float32', new Float32Array(3), dims.k), v: new ort.Tensor('float32', Float32Array.from([1, 2, 4]), dims.v) });
  assert.deepEqual(Array.from(r.y.data), [1, 1.5]);          // top_left; bottom_right would give [1.5, 7/3]
  await s.release();
});

// ---- --op mha and --op gqa (the contrib operators) --------------------------------------------

// Cases with D = 8 whose scores are exact: q[b,h,i] = (a, 0, ...), k[b,g,j] = (c, 0, ...), scale 1,
// so s_ij = a c; v[b,g,j,d] = vv(b, g, j, d).
function contribCase({ B = 1, Hq, Hkv, Nq, Nk, D = 8, Dv = D, qa, kc, vv }) {
  const q = new Float32Array(B * Hq * Nq * D);
  const k = new Float32Array(B * Hkv * Nk * D);
  const v = new Float32Array(B * Hkv * Nk * Dv);
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < Hq; h++) for (let i = 0; i < Nq; i++) q[((b * Hq + h) * Nq + i) * D] = qa(b, h, i);
    for (let g = 0; g < Hkv; g++) {
      for (let j = 0; j < Nk; j++) {
        k[((b * Hkv + g) * Nk + j) * D] = kc(b, g, j);
        for (let d = 0; d < Dv; d++) v[((b * Hkv + g) * Nk + j) * Dv + d] = vv(b, g, j, d);
      }
    }
  }
  return { q: T('F32', [B, Hq, Nq, D], q), k: T('F32', [B, Hkv, Nk, D], k), v: T('F32', [B, Hkv, Nk, Dv], v) };
}

/** out [B,Hq,Nq,Dv] of a contribCase by hand: softmax over the allowed keys; `empty` for none. */
function contribOut(c, allowed, empty = 0) {
  const { B = 1, Hq, Hkv, Nq, Nk, Dv = c.D || 8 } = c;
  const out = [];
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < Hq; h++) {
      const g = Math.floor(h / (Hq / Hkv));
      for (let i = 0; i < Nq; i++) {
        const js = [...Array(Nk).keys()].filter((j) => allowed(b, h, i, j));
        const p = softmax(js.map((j) => c.qa(b, h, i) * c.kc(b, g, j)));
        for (let d = 0; d < Dv; d++) out.push(js.length ? js.reduce((s, j, n) => s + p[n] * c.vv(b, g, j, d), 0) : empty);
      }
    }
  }
  return out;
}

const spec = {
  Hq: 4, Hkv: 2, Nq: 2, Nk: 3, B: 2,
  qa: (b, h, i) => [0.5, -1, 1.5, 2][h] + i + b,
  kc: (b, g, j) => [1, 0, -0.5][j] + g - b / 2,
  vv: (b, g, j, d) => (b + 2 * g + j) / 4 + d / 16,
};

ortTest('--op gqa: GQA mapping h / (Hq/Hkv), no mask, the past split, one node per batch element', (w) => {
  const r = w.one(contribCase(spec), meta({ scale: '1', outputs: 'out,weights' }), ['--op', 'gqa']);
  close(r.out.v, contribOut(spec, () => true), 1e-5, 'out');
  assert.deepEqual(r.out.shape, [2, 4, 2, 8]);
  assert.deepEqual(r.weights.shape, [2, 4, 2, 3]);
  close(r.weights.v.slice(0, 3), softmax([0, 1, 2].map((j) => 0.5 * spec.kc(0, 0, j))), 1e-6, 'weights row 0');
});

ortTest('--op gqa: causal bottom_right through the operator, top_left and a window through the bias', (w) => {
  const br = w.one(contribCase(spec), meta({ scale: '1', causal: 'bottom_right' }), ['--op', 'gqa']);
  close(br.out.v, contribOut(spec, (b, h, i, j) => j <= i + 1), 1e-5, 'bottom_right');
  const tl = w.one(contribCase(spec), meta({ scale: '1', causal: 'top_left' }), ['--op', 'gqa']);
  close(tl.out.v, contribOut(spec, (b, h, i, j) => j <= i), 1e-5, 'top_left');
  // window "1,0" with causal (Nq = Nk): local_window_size 2, row i sees i - 1 and i
  const sq = { ...spec, Nq: 3, B: 1 };
  const win = w.one(contribCase(sq), meta({ scale: '1', causal: 'bottom_right', window: '1,0' }), ['--op', 'gqa']);
  close(win.out.v, contribOut(sq, (b, h, i, j) => j <= i && j >= i - 1), 1e-5, 'window 1,0');
  const noc = w.one(contribCase(sq), meta({ scale: '1', window: '0,1' }), ['--op', 'gqa']);
  close(noc.out.v, contribOut(sq, (b, h, i, j) => j >= i && j <= i + 1), 1e-5, 'window 0,1 without causal');
});

ortTest('--op mha: causal bottom_right with Nq < Nk and a mask, through attention_bias', (w) => {
  const m = { ...spec, Hkv: 4 };
  const br = w.one(contribCase(m), meta({ scale: '1', causal: 'bottom_right' }), ['--op', 'mha']);
  close(br.out.v, contribOut(m, (b, h, i, j) => j <= i + 1), 1e-5, 'bottom_right');
  const mask = [1, 0, 1, 1, 1, 0];          // [Nq, Nk]
  const r = w.one({ ...contribCase(m), mask: T('BOOL', [2, 3], mask) }, meta({ scale: '1' }), ['--op', 'mha']);
  close(r.out.v, contribOut(m, (b, h, i, j) => mask[i * 3 + j] === 1), 1e-5, 'mask');
  assert.equal(r.weights, undefined);
});

ortTest('--op mha: unidirectional with Nq = Nk is causal (either alignment)', (w) => {
  const sq = { ...spec, Hkv: 4, Nq: 3 };
  const r = w.one(contribCase(sq), meta({ scale: '1', causal: 'top_left' }), ['--op', 'mha']);
  close(r.out.v, contribOut(sq, (b, h, i, j) => j <= i), 1e-5, 'causal');
});

ortTest('--op gqa and --op mha: sequence lengths go into attention_bias with the causal option', (w) => {
  // the operators' own causal masks are off: they align to the padded sizes
  const lq = [1, 2]; const lk = [3, 2];            // shifts 2 and 0, the padded sizes' 1
  const lengths = { seqlens_q: T('I32', [2], lq), seqlens_k: T('I64', [2], lk) };
  const br = (b, h, i, j) => j < lk[b] && j <= i + lk[b] - lq[b];
  for (const [op, c] of [['gqa', spec], ['mha', { ...spec, Hkv: 4 }]]) {
    const got = w.one({ ...contribCase(c), ...lengths }, meta({ scale: '1', causal: 'bottom_right' }), ['--op', op]);
    close(got.out.v, contribOut(c, br), 1e-5, `--op ${op} bottom_right`);
    const tl = w.one({ ...contribCase(c), ...lengths }, meta({ scale: '1', causal: 'top_left' }), ['--op', op]);
    close(tl.out.v, contribOut(c, (b, h, i, j) => j < lk[b] && j <= i), 1e-5, `--op ${op} top_left`);
    const keys = w.one({ ...contribCase(c), ...lengths }, meta({ scale: '1' }), ['--op', op]);
    close(keys.out.v, contribOut(c, (b, h, i, j) => j < lk[b]), 1e-5, `--op ${op} keys only`);
  }
});

/** out and weights [B,Hq,Nq,*] of a contribCase with a sink logit per query head, by hand. */
function sinkOut(c, allowed, sinks) {
  const { B = 1, Hq, Hkv, Nq, Nk, Dv = c.D || 8 } = c;
  const out = []; const weights = [];
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < Hq; h++) {
      const g = Math.floor(h / (Hq / Hkv));
      for (let i = 0; i < Nq; i++) {
        const s = [...Array(Nk).keys()].map((j) => (allowed(b, h, i, j) ? c.qa(b, h, i) * c.kc(b, g, j) : -Infinity));
        const p = softmax([...s, sinks[h]]).slice(0, Nk);         // the sink: one more logit, no value
        weights.push(...p);
        for (let d = 0; d < Dv; d++) out.push(p.reduce((t, pj, j) => t + pj * c.vv(b, g, j, d), 0));
      }
    }
  }
  return { out, weights };
}

ortTest('--op gqa: sinks go to head_sink, one per query head, with the past split and per-batch nodes', (w) => {
  const sinks = [0.5, -1, 2, 0];
  const t = { ...contribCase(spec), sinks: T('F32', [4], sinks) };
  const r = w.one(t, meta({ scale: '1', outputs: 'out,weights' }), ['--op', 'gqa']);
  const want = sinkOut(spec, () => true, sinks);
  close(r.out.v, want.out, 1e-5, 'out');
  close(r.weights.v, want.weights, 1e-6, 'weights');
  // the weights of a row sum to 1 - P_sink: head 1, row 0 (scores -1, 0, 0.5; sink -1) to 0.89
  const row = r.weights.v.slice(1 * 2 * 3, 1 * 2 * 3 + 3).reduce((x, y) => x + y, 0);
  close([row], [1 - Math.exp(-1) / (2 * Math.exp(-1) + 1 + Math.exp(0.5))], 1e-6, 'row sum');
  const br = w.one(t, meta({ scale: '1', causal: 'bottom_right' }), ['--op', 'gqa']);
  close(br.out.v, sinkOut(spec, (b, h, i, j) => j <= i + 1, sinks).out, 1e-5, 'bottom_right');
  // F64 sinks are rounded into the inputs' dtype (head_sink is of type T)
  const f64 = w.one({ ...t, sinks: T('F64', [4], sinks.map((x) => x + 2 ** -40)) }, meta({ scale: '1' }), ['--op', 'gqa']);
  assert.deepEqual(f64.out.v, w.one(t, meta({ scale: '1' }), ['--op', 'gqa']).out.v);
});

ortTest('--op gqa: a fully masked row with a sink gives 0 with causal=0 too (no NaN); F16 sinks', (w) => {
  const sq = { ...spec, Nq: 3, B: 1 };
  const sinks = [1, -2, 0.25, 3];
  const mask = T('BOOL', [3, 3], [1, 1, 1, 0, 0, 0, 1, 0, 1]);       // row 1 fully masked
  const allowed = (b, h, i, j) => [1, 1, 1, 0, 0, 0, 1, 0, 1][i * 3 + j] === 1;
  const r = w.one({ ...contribCase(sq), mask, sinks: T('F32', [4], sinks) }, meta({ scale: '1', outputs: 'out,weights' }),
    ['--op', 'gqa']);
  const want = sinkOut(sq, allowed, sinks);
  close(r.out.v, want.out, 1e-5, 'out');
  close(r.weights.v, want.weights, 1e-6, 'weights');
  // F16: q = 0, so every score is 0; sink 0 takes half of a one-key row: out = v / 2 exactly
  const z = (n) => new Array(n).fill(0);
  const h = w.one({ q: T('F16', [1, 1, 1, 8], z(8)), k: T('F16', [1, 1, 1, 8], z(8)), v: T('F16', [1, 1, 1, 8], [1, 2, 3, 4, 5, 6, 7, 8]),
    sinks: T('F16', [1], [0]) }, meta(), ['--op', 'gqa']);
  assert.equal(h.out.dtype, 'F16');
  assert.deepEqual(h.out.v, [0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4]);
});

ortTest('sinks: unsupported by Attention and MultiHeadAttention (no sink input); a bad shape is an error', (w) => {
  const t = { ...contribCase({ ...spec, Hkv: 4 }), sinks: T('F32', [4], [0, 0, 0, 0]) };
  const [att] = w.run([w.case(t, meta())]);
  assert.equal(att.kind, 'unsupported');
  assert.match(att.text, /^sinks: Attention has no sink input/);
  const [mha] = w.run([w.case(t, meta())], ['--op', 'mha']);
  assert.equal(mha.kind, 'unsupported');
  assert.match(mha.text, /^sinks: MultiHeadAttention has no sink input/);
  const [bad] = w.run([w.case({ ...t, sinks: T('F32', [3], [0, 0, 0]) }, meta())], ['--op', 'gqa']);
  assert.equal(bad.kind, 'error');
  assert.match(bad.text, /^sinks: shape \[3\], expected \[4\]/);
});

ortTest('gradients (dq, dk, dv, dbias) are unsupported by every operator, whatever the dtype', (w) => {
  const f32 = { q: T('F32', [1, 1, 1, 8], new Array(8).fill(0)), k: T('F32', [1, 1, 1, 8], new Array(8).fill(0)),
    v: T('F32', [1, 1, 1, 8], new Array(8).fill(1)), dout: T('F32', [1, 1, 1, 8], new Array(8).fill(1)) };
  const bf16 = Object.fromEntries(Object.entries(f32).map(([k, t]) => [k, T('BF16', t.shape, t.data)]));
  const bias = { ...f32, bias: T('F32', [1, 1], [0]) };
  for (const op of ['attention', 'mha', 'gqa']) {
    const res = w.run([w.case(f32, meta({ outputs: 'out,dq,dk,dv' })), w.case(bf16, meta({ outputs: 'dv' })),
      w.case(bias, meta({ outputs: 'out,dbias' })), w.case(f32, meta({ outputs: 'out' }))], ['--op', op]);
    assert.deepEqual(res.map((r) => r.kind), ['unsupported', 'unsupported', 'unsupported', 'ok'], op);
    assert.equal(res[0].text, 'gradients: ONNX Runtime inference has no backward (attn.outputs asks for dq, dk, dv)\n');
    assert.match(res[1].text, /^gradients: .* asks for dv\)/);
    assert.match(res[2].text, /^gradients: .* asks for dbias\)/);
  }
});

ortTest('split-KV partial states and kind merge are unsupported, naming the feature', (w) => {
  const t = { q: T('F32', [1, 1, 1, 8], new Array(8).fill(0)), k: T('F32', [1, 1, 2, 8], new Array(16).fill(0)),
    v: T('F32', [1, 1, 2, 8], new Array(16).fill(1)) };
  const merge = { o_partial: T('F32', [2, 1, 1, 1, 8], new Array(16).fill(1)), lse_partial: T('F32', [2, 1, 1, 1], [0, 0]) };
  const res = w.run([w.case(t, meta({ kv_split_size: 1, outputs: 'out,out_partial,lse_partial' })),
    w.case(merge, meta({ kind: 'merge' })), w.case(t, meta())]);
  assert.deepEqual(res.map((r) => r.kind), ['unsupported', 'unsupported', 'ok']);
  assert.match(res[0].text, /^attn.kv_split_size: /);
  assert.match(res[1].text, /^attn.kind merge: /);
});

// ONNX Runtime 1.30.0 bugs, by hand (expected_failures.json lists the core cases they fail): when
// one of these assertions fails, the bug is fixed upstream.
ortTest('ONNX Runtime bug: MultiHeadAttention unidirectional=1, Nq < Nk: the last row sees every key', (w) => {
  const m = { ...spec, Hkv: 4, Nq: 2, Nk: 4, kc: (b, g, j) => [1, 0, -0.5, 2][j] + g - b / 2 };
  const r = w.one(contribCase(m), meta({ scale: '1', causal: 'top_left' }), ['--op', 'mha']);
  const bug = contribOut(m, (b, h, i, j) => (i === m.Nq - 1 ? true : j <= i));
  close(r.out.v, bug, 1e-5, 'rows 0..Nq-2 top-left, the last row unmasked');
  assert.ok(Math.abs(r.out.v[8] - contribOut(m, (b, h, i, j) => j <= i)[8]) > 0.1, 'top_left would differ');
});

ortTest('ONNX Runtime bug: GroupQueryAttention fully masked row: NaN with causal=0, 0 with causal=1', (w) => {
  const sq = { ...spec, Nq: 3, B: 1 };
  const mask = T('BOOL', [3, 3], [1, 1, 1, 0, 0, 0, 1, 1, 1]);       // row 1 fully masked
  const nc = w.one({ ...contribCase(sq), mask }, meta({ scale: '1', masked_rows: 'zero' }), ['--op', 'gqa']);
  const c1 = w.one({ ...contribCase(sq), mask }, meta({ scale: '1', masked_rows: 'zero', causal: 'bottom_right' }), ['--op', 'gqa']);
  close(nc.out.v, contribOut(sq, (b, h, i) => i !== 1, NaN), 1e-5, 'causal=0');
  close(c1.out.v, contribOut(sq, (b, h, i, j) => i !== 1 && j <= i, 0), 1e-5, 'causal=1');
});

ortTest('--op mha and --op gqa: what the operators cannot express is unsupported, naming it', (w) => {
  const base = contribCase({ ...spec, B: 1 });
  const cases = [
    [['--op', 'mha'], base, {}, /one kv head per query head/],
    [['--op', 'mha'], contribCase({ ...spec, Hkv: 4 }), { softcap: '5' }, /no softcap/],
    [['--op', 'gqa'], contribCase({ ...spec, D: 4 }), {}, /multiple of 8/],
    [['--op', 'gqa'], contribCase({ ...spec, Dv: 16 }), {}, /Dk = Dv/],
    [['--op', 'gqa'], contribCase({ ...spec, Nq: 4 }), {}, /Nq <= Nk/],
    [['--op', 'mha'], { q: T('BF16', [1, 1, 1, 8], new Array(8).fill(0)), k: T('BF16', [1, 1, 1, 8], new Array(8).fill(0)),
      v: T('BF16', [1, 1, 1, 8], new Array(8).fill(0)) }, {}, /CPU MultiHeadAttention: BF16 inputs not supported/],
  ];
  const results = cases.map(([flags, t, m]) => w.run([w.case(t, meta({ scale: '1', ...m }))], flags)[0]);
  results.forEach((r, i) => {
    assert.equal(r.kind, 'unsupported', `case ${i}: ${r.text}`);
    assert.match(r.text, cases[i][3]);
  });
});

test('--op takes attention, mha or gqa only (exit 2, saying so)', () => {
  const p = spawnSync(process.execPath, [ADAPTER, '--op', 'flash', '/nonexistent.jsonl'], { encoding: 'utf8' });
  assert.equal(p.status, 2);
  assert.match(p.stderr, /--op must be one of attention, mha, gqa/);
  const f = spawnSync(process.execPath, [ADAPTER, '--op', 'gqa', '--f64', '/nonexistent.jsonl'], { encoding: 'utf8' });
  assert.equal(f.status, 2);
  assert.match(f.stderr, /--f64 is for --op attention only/);
});

// ---- against the reference ------------------------------------------------------------------

const CLI = findCli();
test('random F32 cases agree with attnoracle eval within 1e-5 * out.bound',
  { skip: NO_ORT || (CLI ? false : 'no attnoracle binary (ATTNORACLE_CLI, build/attnoracle, build/tools/attnoracle)') }, () => {
    const w = new Workspace();
    try {
      let seed = 20240601;
      const rnd = () => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648; };
      const normal = () => Math.sqrt(-2 * Math.log(1 - rnd())) * Math.cos(2 * Math.PI * rnd());
      const arr = (n) => Array.from({ length: n }, normal);
      const specs = [
        { B: 1, Hq: 2, Hkv: 2, Nq: 16, Nk: 16, Dk: 8, Dv: 8, m: {} },
        { B: 2, Hq: 4, Hkv: 2, Nq: 5, Nk: 9, Dk: 8, Dv: 4, m: { causal: 'bottom_right' } },
        { B: 1, Hq: 3, Hkv: 1, Nq: 7, Nk: 4, Dk: 16, Dv: 8, m: { causal: 'top_left', softcap: '5' } },
        { B: 1, Hq: 2, Hkv: 2, Nq: 6, Nk: 10, Dk: 8, Dv: 8, m: { window: '2,1', outputs: 'out,weights' }, bias: true },
        { B: 1, Hq: 2, Hkv: 2, Nq: 6, Nk: 6, Dk: 4, Dv: 4, m: { kind: 'mha' } },
      ];
      const cases = specs.map((c) => {
        const t = c.m.kind === 'mha'
          ? { x_q: T('F32', [c.B, c.Nq, 5], arr(c.B * c.Nq * 5)), w_q: T('F32', [c.Hq, 5, c.Dk], arr(c.Hq * 5 * c.Dk)),
            w_k: T('F32', [c.Hq, 5, c.Dk], arr(c.Hq * 5 * c.Dk)), w_v: T('F32', [c.Hq, 5, c.Dv], arr(c.Hq * 5 * c.Dv)),
            w_o: T('F32', [c.Hq * c.Dv, 3], arr(c.Hq * c.Dv * 3)) }
          : { q: T('F32', [c.B, c.Hq, c.Nq, c.Dk], arr(c.B * c.Hq * c.Nq * c.Dk)),
            k: T('F32', [c.B, c.Hkv, c.Nk, c.Dk], arr(c.B * c.Hkv * c.Nk * c.Dk)),
            v: T('F32', [c.B, c.Hkv, c.Nk, c.Dv], arr(c.B * c.Hkv * c.Nk * c.Dv)) };
        if (t.x_q) t.x_kv = t.x_q;
        if (c.bias) t.bias = T('F32', [c.Nq, c.Nk], arr(c.Nq * c.Nk).map((x, i) => (i % 7 === 3 ? -Infinity : x)));
        return w.case(t, meta(c.m));
      });
      const results = w.run(cases);
      cases.forEach((c, i) => {
        const gold = c.replace('.safetensors', '.gold.safetensors');
        execFileSync(CLI, ['eval', c, '-o', gold, '-q']);
        const g = st.read(gold).tensors;
        assert.equal(results[i].kind, 'ok', results[i].text);
        const y = st.values(results[i].tensors.out);
        const ref = st.values(g['out.ref']);
        const bound = st.values(g['out.bound']);
        for (let j = 0; j < y.length; j++) {
          assert.ok(Math.abs(y[j] - ref[j]) <= 1e-5 * bound[j] + 2 ** -126,
            `case ${i} element ${j}: ${y[j]} vs ${ref[j]} (bound ${bound[j]})`);
        }
        if (results[i].tensors.weights) {
          const wt = st.values(results[i].tensors.weights);
          const wr = st.values(g['weights.ref']);
          for (let j = 0; j < wt.length; j++) assert.ok(Math.abs(wt[j] - wr[j]) <= 1e-6, `weights ${j}`);
        }
      });
    } finally {
      w.close();
    }
  });
