'use strict';
// Reads and writes safetensors files in plain JavaScript (Node.js, no dependency).
//
//   const st = require('./safetensors');
//   const { tensors, metadata } = st.read('case.safetensors');
//   // tensors.q = { dtype: 'F16', shape: [1, 2, 3, 4], data: Uint16Array (the F16 bits) }
//   st.write('out.safetensors', { out: { dtype: 'F32', shape: [2], data: [1, 2] } }, { key: 'v' });
//
// Dtypes and how their data is held in memory:
//   F64 Float64Array, F32 Float32Array, F16 and BF16 Uint16Array (the bit patterns),
//   BOOL Uint8Array (0 or 1), I64 BigInt64Array, I32 Int32Array.
// `values(t)` gives any floating tensor as a Float64Array of its exact values. When writing,
// `data` may also be any array of numbers: it is rounded once, to nearest-even, into the dtype
// (F16 and BF16 directly from the double, never through float32; overflow gives infinity,
// subnormals are kept, NaN stays NaN).

const fs = require('fs');

const SIZES = { F64: 8, F32: 4, F16: 2, BF16: 2, BOOL: 1, I64: 8, I32: 4 };
const ARRAYS = {
  F64: Float64Array, F32: Float32Array, F16: Uint16Array, BF16: Uint16Array,
  BOOL: Uint8Array, I64: BigInt64Array, I32: Int32Array,
};

class UnsupportedDtype extends Error {}
class FormatError extends Error {}

// ---- float16 and bfloat16 by hand ---------------------------------------------------------

const f64 = new Float64Array(1);
const f64Words = new Uint32Array(f64.buffer);   // little-endian host: [low, high]
const f32 = new Float32Array(1);
const f32Word = new Uint32Array(f32.buffer);

/** The binade exponent floor(log2 |x|) of a finite nonzero double (exact, from its bits). */
function exponentOf(x) {
  f64[0] = x;
  const e = ((f64Words[1] >>> 20) & 0x7ff) - 1023;
  if (e > -1023) return e;
  return -1023;  // subnormal doubles: far below every format handled here
}

/** Rounds x half to even to an integer (|x| < 2^52, so x - floor(x) is exact). */
function roundHalfEven(x) {
  const f = Math.floor(x);
  const d = x - f;
  if (d > 0.5) return f + 1;
  if (d < 0.5) return f;
  return f % 2 === 0 ? f : f + 1;
}

/**
 * Rounds the double x to nearest-even in a binary format with p significand bits (counting the
 * hidden one), minimum normal exponent emin and largest finite value maxFinite; returns the
 * rounded value as a double (exact), or +-Infinity on overflow.
 */
function roundToFormat(x, p, emin, maxFinite) {
  if (!Number.isFinite(x) || x === 0) return x;
  const e = Math.max(exponentOf(x), emin);
  const quantum = 2 ** (e - p + 1);        // spacing of the format in x's binade (or subnormals)
  const r = roundHalfEven(x / quantum) * quantum;   // x / quantum is exact: a power of two
  if (Math.abs(r) > maxFinite) return x > 0 ? Infinity : -Infinity;
  return r;
}

const HALF_MAX = 65504;
const BF16_MAX = 3.3895313892515355e38;  // (2 - 2^-7) * 2^127

/** F16 bits -> value. */
function halfToNumber(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const man = h & 0x3ff;
  if (exp === 0) return sign * man * 2 ** -24;
  if (exp === 31) return man ? NaN : sign * Infinity;
  return sign * (1024 + man) * 2 ** (exp - 25);
}

/** A double -> F16 bits, rounded once to nearest-even. */
function numberToHalf(x) {
  if (Number.isNaN(x)) return 0x7e00;
  const sign = x < 0 || Object.is(x, -0) ? 0x8000 : 0;
  const r = Math.abs(roundToFormat(x, 11, -14, HALF_MAX));
  if (r === Infinity) return sign | 0x7c00;
  if (r < 2 ** -14) return sign | (r / 2 ** -24);          // subnormal (or zero)
  const e = exponentOf(r);
  return sign | ((e + 15) << 10) | (r / 2 ** (e - 10) - 1024);
}

/** BF16 bits -> value (the upper half of a float32). */
function bf16ToNumber(h) {
  f32Word[0] = (h & 0xffff) << 16;
  return f32[0];
}

/** A double -> BF16 bits, rounded once to nearest-even. */
function numberToBf16(x) {
  if (Number.isNaN(x)) return 0x7fc0;
  const r = roundToFormat(x, 8, -126, BF16_MAX);
  f32[0] = Object.is(x, -0) ? -0 : r;                       // exact: r is a bfloat16 value
  return f32Word[0] >>> 16;
}

// ---- reading --------------------------------------------------------------------------------

/**
 * Reads a safetensors file -> { tensors: name -> {dtype, shape, data}, metadata: key -> string }.
 * Throws UnsupportedDtype for a dtype outside F64, F32, F16, BF16, BOOL, I64, I32, FormatError for a
 * malformed file.
 */
function read(path) {
  const raw = fs.readFileSync(path);
  if (raw.length < 8) throw new FormatError(`${path}: shorter than 8 bytes`);
  const n = Number(raw.readBigUInt64LE(0));
  if (n > raw.length - 8) throw new FormatError(`${path}: header length ${n} past the end`);
  let header;
  try {
    header = JSON.parse(raw.subarray(8, 8 + n).toString('utf8'));
  } catch (e) {
    throw new FormatError(`${path}: header is not JSON: ${e.message}`);
  }
  const metadata = header.__metadata__ || {};
  delete header.__metadata__;
  const base = 8 + n;
  const tensors = {};
  for (const [name, t] of Object.entries(header)) {
    if (!(t.dtype in SIZES)) {
      throw new UnsupportedDtype(`tensor ${name}: dtype ${t.dtype} is not supported`);
    }
    const [begin, end] = t.data_offsets;
    const count = t.shape.reduce((a, b) => a * b, 1);
    if (end - begin !== count * SIZES[t.dtype] || base + end > raw.length) {
      throw new FormatError(`${path}: tensor ${name}: data_offsets do not match its shape`);
    }
    const bytes = new Uint8Array(count * SIZES[t.dtype]);       // a copy: aligned
    bytes.set(raw.subarray(base + begin, base + end));
    tensors[name] = { dtype: t.dtype, shape: t.shape.slice(), data: new ARRAYS[t.dtype](bytes.buffer) };
  }
  return { tensors, metadata };
}

/** A floating tensor's values as a Float64Array (exact). BOOL gives 0/1, I64 and I32 Number(). */
function values(t) {
  const out = new Float64Array(t.data.length);
  if (t.dtype === 'F16') for (let i = 0; i < out.length; i++) out[i] = halfToNumber(t.data[i]);
  else if (t.dtype === 'BF16') for (let i = 0; i < out.length; i++) out[i] = bf16ToNumber(t.data[i]);
  else if (t.dtype === 'I64') for (let i = 0; i < out.length; i++) out[i] = Number(t.data[i]);
  else out.set(t.data);
  return out;
}

// ---- writing --------------------------------------------------------------------------------

/** `data` as the typed array of `dtype`, rounding numbers into it when needed. */
function toStored(dtype, data) {
  const A = ARRAYS[dtype];
  if (data instanceof A && !(dtype === 'BF16' || dtype === 'F16')) return data;
  if ((dtype === 'F16' || dtype === 'BF16') && data instanceof Uint16Array) return data;  // bits
  const out = new A(data.length);
  for (let i = 0; i < data.length; i++) {
    const x = data[i];
    if (dtype === 'F16') out[i] = numberToHalf(Number(x));
    else if (dtype === 'BF16') out[i] = numberToBf16(Number(x));
    else if (dtype === 'BOOL') out[i] = x ? 1 : 0;
    else if (dtype === 'I64') out[i] = BigInt(x);
    else out[i] = Number(x);                                  // F32: rounded to nearest-even
  }
  return out;
}

/**
 * Writes tensors (name -> {dtype, shape, data}) sorted by name, with string metadata, to a
 * temporary name in the same folder, then renames it into place.
 */
function write(path, tensors, metadata) {
  const header = {};
  const blobs = [];
  let offset = 0;
  for (const name of Object.keys(tensors).sort()) {
    const t = tensors[name];
    if (!(t.dtype in SIZES)) throw new UnsupportedDtype(`tensor ${name}: dtype ${t.dtype}`);
    const count = t.shape.reduce((a, b) => a * b, 1);
    const stored = toStored(t.dtype, t.data);
    if (stored.length !== count) {
      throw new FormatError(`tensor ${name}: ${stored.length} values for shape [${t.shape}]`);
    }
    const bytes = Buffer.from(stored.buffer, stored.byteOffset, stored.byteLength);
    header[name] = { dtype: t.dtype, shape: t.shape.slice(), data_offsets: [offset, offset + bytes.length] };
    blobs.push(bytes);
    offset += bytes.length;
  }
  if (metadata && Object.keys(metadata).length) {
    for (const [k, v] of Object.entries(metadata)) {
      if (typeof v !== 'string') throw new TypeError(`metadata ${k}: values must be strings`);
    }
    header.__metadata__ = { ...metadata };
  }
  let text = JSON.stringify(header);
  text += ' '.repeat((8 - (Buffer.byteLength(text) % 8)) % 8);   // pad the header to 8 bytes
  const head = Buffer.alloc(8);
  head.writeBigUInt64LE(BigInt(Buffer.byteLength(text)));
  const tmp = `${path}.tmp${process.pid}`;
  try {
    fs.writeFileSync(tmp, Buffer.concat([head, Buffer.from(text, 'utf8'), ...blobs]));
    fs.renameSync(tmp, path);
  } catch (e) {
    try { fs.unlinkSync(tmp); } catch (_) { /* already gone */ }
    throw e;
  }
}

module.exports = {
  read, write, values, UnsupportedDtype, FormatError,
  halfToNumber, numberToHalf, bf16ToNumber, numberToBf16, roundToFormat,
};
