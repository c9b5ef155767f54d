'use strict';
// Builds an ONNX ModelProto in bytes, by hand: a minimal protobuf encoder (varints and
// length-delimited fields) and the few onnx.proto messages a graph of a handful of nodes needs.
//
//   const onnx = require('./onnx_model');
//   const bytes = onnx.model({
//     nodes: [onnx.node('MatMul', ['a', 'b'], ['c'])],
//     inputs: [onnx.valueInfo('a', onnx.FLOAT, [2, 3]), onnx.valueInfo('b', onnx.FLOAT, [3, 4])],
//     outputs: [onnx.valueInfo('c', onnx.FLOAT, [2, 4])],
//   });                                    // Uint8Array: ir_version 10, opset {"" 23}
//
// Field numbers are those of onnx/onnx.proto (proto2):
//   ModelProto        ir_version 1, producer_name 2, producer_version 3, graph 7, opset_import 8
//   OperatorSetIdProto domain 1, version 2
//   GraphProto        node 1, name 2, initializer 5, input 11, output 12
//   NodeProto         input 1, output 2, name 3, op_type 4, attribute 5, domain 7
//   AttributeProto    name 1, f 2, i 3, s 4, ints 8, type 20 (FLOAT 1, INT 2, STRING 3, INTS 7)
//   ValueInfoProto    name 1, type 2
//   TypeProto         tensor_type 1;  TypeProto.Tensor elem_type 1, shape 2
//   TensorShapeProto  dim 1;  Dimension dim_value 1
//   TensorProto       dims 1, data_type 2, name 8, raw_data 9
// Data types (TensorProto.DataType): FLOAT 1, INT32 6, INT64 7, BOOL 9, FLOAT16 10, DOUBLE 11, BFLOAT16 16.

const FLOAT = 1;
const INT64 = 7;
const BOOL = 9;
const FLOAT16 = 10;
const DOUBLE = 11;
const INT32 = 6;
const BFLOAT16 = 16;

const WIRE_VARINT = 0;
const WIRE_LEN = 2;
const WIRE_I32 = 5;

/** A protobuf varint; negative numbers as 64-bit two's complement (10 bytes), as int64 wants. */
function varint(value) {
  let v = BigInt.asUintN(64, BigInt(value));
  const out = [];
  do {
    let byte = Number(v & 0x7fn);
    v >>= 7n;
    if (v !== 0n) byte |= 0x80;
    out.push(byte);
  } while (v !== 0n);
  return Uint8Array.from(out);
}

function concat(parts) {
  const total = parts.reduce((n, p) => n + p.length, 0);
  const out = new Uint8Array(total);
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

function tag(field, wire) {
  return varint((field << 3) | wire);
}

/** Field `field` holding an integer (int32, int64, enum). */
function fInt(field, value) {
  return concat([tag(field, WIRE_VARINT), varint(value)]);
}

/** Field `field` holding a float32 (rounded to nearest float32). */
function fFloat(field, value) {
  const b = new Uint8Array(4);
  new DataView(b.buffer).setFloat32(0, value, true);
  return concat([tag(field, WIRE_I32), b]);
}

/** Field `field` holding bytes, a string (UTF-8) or an encoded message. */
function fBytes(field, data) {
  const bytes = typeof data === 'string' ? new TextEncoder().encode(data) : data;
  return concat([tag(field, WIRE_LEN), varint(bytes.length), bytes]);
}

// ---- onnx.proto messages ---------------------------------------------------------------------

/** AttributeProto from a name and {f: float} | {i: int} | {s: string} | {ints: [int...]}. */
function attribute(name, value) {
  const parts = [fBytes(1, name)];
  if ('f' in value) parts.push(fFloat(2, value.f), fInt(20, 1));
  else if ('i' in value) parts.push(fInt(3, value.i), fInt(20, 2));
  else if ('s' in value) parts.push(fBytes(4, value.s), fInt(20, 3));
  else if ('ints' in value) {
    for (const v of value.ints) parts.push(fInt(8, v));
    parts.push(fInt(20, 7));
  } else throw new TypeError(`attribute ${name}: give {f}, {i}, {s} or {ints}`);
  return concat(parts);
}

/**
 * NodeProto. `attrs` maps attribute names to {f: number} | {i: number} | {s: string} |
 * {ints: [...]}; an empty string in `inputs`/`outputs` is an absent optional argument. `domain`
 * is the operator set ('' for ai.onnx, 'com.microsoft' for ONNX Runtime's contrib operators).
 */
function node(opType, inputs, outputs, attrs = {}, name = '', domain = '') {
  const parts = [];
  for (const i of inputs) parts.push(fBytes(1, i));
  for (const o of outputs) parts.push(fBytes(2, o));
  if (name) parts.push(fBytes(3, name));
  parts.push(fBytes(4, opType));
  for (const [k, v] of Object.entries(attrs)) parts.push(fBytes(5, attribute(k, v)));
  parts.push(fBytes(7, domain));      // '' is the default (ai.onnx) domain
  return concat(parts);
}

/** ValueInfoProto of a tensor with element type `elemType` and fixed shape `dims`. */
function valueInfo(name, elemType, dims) {
  const shape = concat(dims.map((d) => fBytes(1, fInt(1, d))));
  const tensorType = concat([fInt(1, elemType), fBytes(2, shape)]);
  const type = fBytes(1, tensorType);
  return concat([fBytes(1, name), fBytes(2, type)]);
}

/** TensorProto (an initializer) from a typed array; raw_data little-endian. */
function tensor(name, elemType, dims, data) {
  const raw = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  const parts = dims.map((d) => fInt(1, d));
  parts.push(fInt(2, elemType), fBytes(8, name), fBytes(9, raw));
  return concat(parts);
}

/** GraphProto from encoded nodes, inputs, outputs and initializers. */
function graph({ nodes, inputs, outputs, initializers = [], name = 'attnoracle' }) {
  return concat([
    ...nodes.map((n) => fBytes(1, n)),
    fBytes(2, name),
    ...initializers.map((t) => fBytes(5, t)),
    ...inputs.map((v) => fBytes(11, v)),
    ...outputs.map((v) => fBytes(12, v)),
  ]);
}

/**
 * ModelProto bytes: ir_version 10, opset_import {domain "", version `opset`}, and
 * {domain "com.microsoft", version 1} too when `contrib` is set.
 */
function model(g, { opset = 23, irVersion = 10, producer = 'attnoracle-onnxruntime-adapter', contrib = false } = {}) {
  const imports = [concat([fBytes(1, ''), fInt(2, opset)])];
  if (contrib) imports.push(concat([fBytes(1, 'com.microsoft'), fInt(2, 1)]));
  return concat([
    fInt(1, irVersion),
    fBytes(2, producer),
    fBytes(7, graph(g)),
    ...imports.map((i) => fBytes(8, i)),
  ]);
}

module.exports = {
  FLOAT, INT32, INT64, BOOL, FLOAT16, DOUBLE, BFLOAT16,
  varint, attribute, node, valueInfo, tensor, graph, model,
};
