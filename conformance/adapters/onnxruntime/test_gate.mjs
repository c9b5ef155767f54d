// The contrib operators through the gate: `attnoracle run vectors/core` on adapter.js --op mha and
// --op gqa under their profile families (conformance/profiles/onnxruntime-{mha,gqa}.json: the
// F32 and F16 profiles, one run each).
//
//   node --test conformance/adapters/onnxruntime/test_gate.mjs
//
// Each run passes only when exactly the cases listed in expected_failures.json fail, each for its
// bug's reason, and at least `least_passed` cases pass (`least_passed_tagged`: at least so many
// of the cases with a tag, such as the sinks cases for --op gqa). A listed case that passes
// fails the test, naming it: the bug is fixed upstream (or no longer reached), and its entry is
// to be removed.
// Skipped, saying why, without node_modules/onnxruntime-node or the attnoracle binary
// (ATTNORACLE_CLI, build/attnoracle or build/tools/attnoracle).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const require = createRequire(import.meta.url);
const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO = path.resolve(HERE, '..', '..', '..');
const CORE = path.join(REPO, 'vectors', 'core');
const st = require('./safetensors.js');
const EXPECTED = JSON.parse(fs.readFileSync(path.join(HERE, 'expected_failures.json'), 'utf8'));

const HAVE_ORT = fs.existsSync(path.join(HERE, 'node_modules', 'onnxruntime-node', 'package.json'));
const CLI = [process.env.ATTNORACLE_CLI, path.join(REPO, 'build', 'attnoracle'), path.join(REPO, 'build', 'tools', 'attnoracle')]
  .find((c) => c && fs.existsSync(c));
const SKIP = !HAVE_ORT ? `node_modules/onnxruntime-node is missing: run \`npm ci --ignore-scripts\` in ${HERE}`
  : !CLI ? 'the attnoracle binary was not found (ATTNORACLE_CLI, build/attnoracle or build/tools/attnoracle)' : false;
if (SKIP) console.log(`# skipping the ONNX Runtime gate tests: ${SKIP}`);

/** `attnoracle run vectors/core` on adapter.js --op OP under PROFILE -> {status, report, output}. */
function gate(op, profile) {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'ort_gate_'));
  try {
    const json = path.join(tmp, 'report.json');
    const p = spawnSync(CLI, ['run', CORE, '--impl', `node '${path.join(HERE, 'adapter.js')}' --op ${op}`,
      '--profile', path.join(REPO, 'conformance', 'profiles', profile), '--threads', '2', '--json', json],
    { cwd: REPO, encoding: 'utf8', timeout: 600000 });
    const output = `${p.stdout}${p.stderr}`;
    assert.ok(p.status === 0 || p.status === 1, `attnoracle run exited ${p.status}: ${output}`);
    return { status: p.status, report: JSON.parse(fs.readFileSync(json, 'utf8')), output };
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
}

/** The number of query rows of a core case (q [B,Hq,Nq,Dk], or x_q [B,Nq,D] for kind mha). */
function queryRows(id) {
  const { tensors } = st.read(path.join(CORE, 'cases', `${id}.safetensors`));
  return tensors.q ? tensors.q.shape[2] : tensors.x_q.shape[1];
}

/** Why a failed case does not show the known bug, or null when it does. */
function mismatch(c, bug) {
  if (!new RegExp(bug.reason).test(c.reason)) return `reason "${c.reason}" does not match /${bug.reason}/`;
  if (bug.last_row) {
    const idx = c.worst && c.worst.index;
    const rowAxis = c.worst && c.worst.tensor === 'out' && idx && idx.length === 3 ? 1 : 2;
    const last = queryRows(c.id) - 1;
    if (!idx || idx[rowAxis] !== last) {
      return `the worst element ${c.worst ? `${c.worst.tensor}[${idx}]` : '(none)'} is not on the last query row ${last}`;
    }
  }
  return null;
}

for (const run of EXPECTED.runs) {
  test(`--op ${run.op} under ${run.profile}: only the known ONNX Runtime bugs fail`, { skip: SKIP }, () => {
    const { status, report, output } = gate(run.op, run.profile);
    const failed = new Map(report.cases.filter((c) => c.status === 'fail').map((c) => [c.id, c]));
    const problems = [];
    for (const [id, bugName] of Object.entries(run.expected)) {
      const bug = EXPECTED.bugs[bugName];
      const c = report.cases.find((x) => x.id === id);
      if (!c) problems.push(`expected failure ${id} (${bugName}) is not in the report`);
      else if (c.status !== 'fail') {
        problems.push(`expected failure ${id} now ${c.status === 'pass' ? 'passes' : `is ${c.status}`}: `
          + `"${bug.what}" looks fixed upstream; remove it from expected_failures.json`);
      } else {
        const why = mismatch(c, bug);
        if (why) problems.push(`expected failure ${id} (${bugName}) fails for another reason: ${why}`);
      }
    }
    for (const [id, c] of failed) {
      if (!(id in run.expected)) problems.push(`unexpected failure ${id}: ${c.reason}`);
    }
    assert.deepEqual(problems, [], `${problems.join('\n')}\n--- attnoracle run output ---\n${output}`);
    assert.equal(status, failed.size > 0 ? 1 : 0);
    assert.ok(report.passed >= run.least_passed, `${report.passed} cases passed, expected at least ${run.least_passed}`);
    for (const [tag, least] of Object.entries(run.least_passed_tagged || {})) {
      const n = report.cases.filter((c) => c.status === 'pass' && c.tags.includes(tag)).length;
      assert.ok(n >= least, `${n} cases tagged ${tag} passed, expected at least ${least}`);
    }
    console.log(`# --op ${run.op} ${run.profile}: ${report.passed} passed, ${report.failed} failed (expected), `
      + `${report.skipped} skipped`);
  });
}
