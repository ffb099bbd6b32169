#!/usr/bin/env bash
# Installs the official `openai` npm SDK (pinned in package.json) into the cache folder for the
# HTTP service tests (idempotent; works offline once installed).
# Cache folder: $TPSERVE_NPM_OPENAI_CACHE or <repo>/.cache/npm-openai (gitignored).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
cache="${TPSERVE_NPM_OPENAI_CACHE:-$repo/.cache/npm-openai}"
mkdir -p "$cache"
cp "$here/package.json" "$cache/package.json"
want="$(node -e 'console.log(require(process.argv[1]).dependencies.openai)' "$here/package.json")"
have="$(node -e 'try{console.log(require(process.argv[1]).version)}catch(e){console.log("")}' \
  "$cache/node_modules/openai/package.json")"
if [[ "$have" != "$want" ]]; then
  echo "setup.sh: npm install openai@$want into $cache"
  (cd "$cache" && npm install --no-audit --no-fund --loglevel=error)
else
  echo "setup.sh: openai@$have already in $cache"
fi
