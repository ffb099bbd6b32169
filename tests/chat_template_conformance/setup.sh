#!/usr/bin/env bash
# Installs the npm reference renderer @huggingface/jinja into the cache folder (idempotent; works
# offline when it is already there). The conformance test runs reference_js.mjs itself.
# Cache folder: $TPSERVE_NPM_JINJA_CACHE or <repo>/.cache/npm-jinja (gitignored).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${TPSERVE_NPM_JINJA_CACHE:-$repo/.cache/npm-jinja}"
mkdir -p "$cache"
cp "$here/package.json" "$cache/package.json"
want="$(node -e 'console.log(require(process.argv[1]).dependencies["@huggingface/jinja"])' \
  "$here/package.json")"
have=""
if [[ -f "$cache/node_modules/@huggingface/jinja/package.json" ]]; then
  have="$(node -e 'console.log(require(process.argv[1]).version)' \
    "$cache/node_modules/@huggingface/jinja/package.json")"
fi
if [[ "$have" != "$want" ]]; then
  echo "setup.sh: npm install @huggingface/jinja@$want into $cache"
  (cd "$cache" && npm install --no-audit --no-fund --loglevel=error)
else
  echo "setup.sh: @huggingface/jinja $have already in $cache"
fi
