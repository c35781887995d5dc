// The modules must run in browsers as they are (no build step): ES modules that import only each
// other and use no Node-only API; package.json publishes exactly them.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';

const read = (f) => readFileSync(new URL(`../${f}`, import.meta.url), 'utf8');
const RUNTIME = ['index.js', 'codec.js', 'client.js'];

test('the runtime modules import only each other and use no Node-only API', () => {
  for (const file of RUNTIME) {
    const src = read(file);
    const imports = [...src.matchAll(/^\s*(?:import|export)\s[^'"]*from\s+['"]([^'"]+)['"]/gm)].map((m) => m[1]);
    for (const spec of imports) assert.match(spec, /^\.\/(codec|client)\.js$/, `${file} imports ${spec}`);
    const code = src.replace(/\/\/.*$/gm, '').replace(/\/\*[\s\S]*?\*\//g, '');
    for (const word of [/\brequire\(/, /\bBuffer\b/, /\bprocess\./, /\b__dirname\b/, /['"]node:/, /\bimport\(/]) {
      assert.doesNotMatch(code, word, `${file} uses ${word}`);
    }
  }
});

test('package.json: an ES module with types, the files it ships, no runtime dependencies, the repo license', () => {
  const pkg = JSON.parse(read('package.json'));
  const cargo = readFileSync(new URL('../../../Cargo.toml', import.meta.url), 'utf8');
  assert.equal(pkg.type, 'module');
  assert.equal(pkg.version, '0.1.0');
  assert.equal(pkg.license, cargo.match(/^license\s*=\s*"([^"]+)"/m)[1]);
  assert.equal(pkg.dependencies, undefined);
  assert.equal(pkg.types, './index.d.ts');
  for (const [entry, target] of Object.entries(pkg.exports)) {
    if (entry === './package.json') continue;
    for (const f of [target.default, target.types]) {
      assert.ok(pkg.files.includes(f.replace(/^\.\//, '')), `${f} is published`);
      assert.ok(read(f).length > 0);
    }
  }
  for (const f of pkg.files) assert.ok(read(f).length > 0, `${f} exists`);
});

test("the README's Node snippet runs as written from the checkout's top directory and prints what it says", async () => {
  const { execFileSync } = await import('node:child_process');
  const { mkdtempSync, writeFileSync, symlinkSync, rmSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const { join } = await import('node:path');
  const { fileURLToPath } = await import('node:url');
  const readme = read('README.md');
  const section = readme.split('\n## Try the codec now (Node)\n')[1].split('\n## ')[0];
  const code = section.match(/```js\n([\s\S]*?)```/)[1];
  assert.match(code, /save as try\.mjs in the checkout's top directory \(next to the clients\/ folder\)/);
  // A top directory of its own, with the checkout's clients/ folder in it, so that nothing is
  // written into the checkout.
  const top = mkdtempSync(join(tmpdir(), 'aqueduct-readme-'));
  try {
    symlinkSync(fileURLToPath(new URL('../../', import.meta.url)), join(top, 'clients'));
    writeFileSync(join(top, 'try.mjs'), code);
    const out = execFileSync(process.execPath, ['try.mjs'], { cwd: top, encoding: 'utf8' });
    const said = [...code.matchAll(/\/\/ (true.*)$/gm)].map((m) => m[1].replace(/\s*$/, ''));
    assert.deepEqual(out.trim().split('\n'), ['true orders hello', 'true']);
    assert.deepEqual(said, ['true orders hello', 'true'], 'the comments say what it prints');
  } finally {
    rmSync(top, { recursive: true, force: true });
  }
});
