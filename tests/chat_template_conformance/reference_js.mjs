// Renders every template of templates.json on every conversation with @huggingface/jinja, the
// way transformers.js' apply_chat_template does (trim_blocks and lstrip_blocks; variables
// messages, bos_token, eos_token, add_generation_prompt, tools).
// usage: node reference_js.mjs CACHE_DIR REPO_DIR OUT_JSON
// Writes {jinja_version, results: [{template, conversation, output} or {..., error}]}.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const [cacheDir, repoDir, outPath] = process.argv.slice(2);
if (!cacheDir || !repoDir || !outPath) {
  console.error("usage: node reference_js.mjs CACHE_DIR REPO_DIR OUT_JSON");
  process.exit(2);
}
const require = createRequire(path.join(path.resolve(cacheDir), "package.json"));
const { Template } = require("@huggingface/jinja");
const version = JSON.parse(fs.readFileSync(path.join(path.resolve(cacheDir), "node_modules",
  "@huggingface", "jinja", "package.json"), "utf8")).version;

const dataDir = path.join(repoDir, "tests", "data", "chat_templates");
const spec = JSON.parse(fs.readFileSync(path.join(dataDir, "templates.json"), "utf8"));
const convs = JSON.parse(fs.readFileSync(
  path.join(repoDir, "tests", "chat_template_conformance", "conversations.json"), "utf8"));

function tokenText(t) {
  if (typeof t === "string") return t;
  if (t && typeof t === "object" && typeof t.content === "string") return t.content;
  return "";
}

const results = [];
for (const t of spec.templates) {
  let source, bos, eos;
  if (t.model_dir) {
    const cfg = JSON.parse(fs.readFileSync(
      path.join(repoDir, t.model_dir, "tokenizer_config.json"), "utf8"));
    source = cfg.chat_template;
    bos = tokenText(cfg.bos_token);
    eos = tokenText(cfg.eos_token);
  } else {
    source = fs.readFileSync(path.join(dataDir, t.file), "utf8");
    bos = t.bos_token;
    eos = t.eos_token;
  }
  const template = new Template(source);
  for (const c of convs.conversations) {
    const r = { template: t.name, conversation: c.name };
    try {
      r.output = template.render({
        messages: c.messages,
        bos_token: bos,
        eos_token: eos,
        add_generation_prompt: c.add_generation_prompt,
        tools: c.tools ?? null,
      });
    } catch (e) {
      r.error = String(e && e.message !== undefined ? e.message : e);
    }
    results.push(r);
  }
}
fs.mkdirSync(path.dirname(outPath), { recursive: true });
fs.writeFileSync(outPath, JSON.stringify({ jinja_version: version, results }));
console.log(`wrote ${outPath} (${results.length} renderings, @huggingface/jinja ${version})`);
