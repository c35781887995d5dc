#!/usr/bin/env bash
# Runs the certificate recipe of docs/howto-tls.md as written (the ```sh block after the comment
# "<!-- scripts/check-howto-tls.sh runs the next sh block as written -->") in a temporary
# directory, and checks what it made with openssl: X.509 v3 certificates, a CA that may sign, a
# broker certificate for serverAuth with localhost, 127.0.0.1 and ::1, a client certificate for
# clientAuth with CN=alice, each verifying against the CA for its purpose.
#
# Needs only openssl and bash (no broker). Usage: scripts/check-howto-tls.sh
# Not part of .ci/run.
set -euo pipefail

doc="$(cd "$(dirname "$0")/.." && pwd)/docs/howto-tls.md"
marker='<!-- scripts/check-howto-tls.sh runs the next sh block as written -->'

recipe="$(awk -v marker="$marker" '
  $0 == marker { armed = 1; next }
  armed && !inside && /^```sh[[:space:]]*$/ { inside = 1; next }
  inside && /^```/ { found = 1; exit }
  inside { print }
  END { if (!found) exit 1 }
' "$doc")" || {
  echo "check-howto-tls: no complete \`\`\`sh block after the marker in $doc" >&2
  exit 1
}

dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cd "$dir"
printf '%s\n' "$recipe" >recipe.sh

failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
ok() { echo "ok: $*"; }

if ! bash -eu recipe.sh >recipe.log 2>&1; then
  cat recipe.log >&2
  echo "check-howto-tls: the recipe failed (openssl $(openssl version))" >&2
  exit 1
fi
ok "the recipe ran ($(openssl version))"

# expect FILE TEXT...: `openssl x509 -text` of FILE contains every TEXT.
expect() {
  local file="$1"
  shift
  local text
  if ! text="$(openssl x509 -in "$file" -noout -text 2>&1)"; then
    fail "$file: not a certificate: $text"
    return
  fi
  local want
  for want in "$@"; do
    if grep -qF -- "$want" <<<"$text"; then
      ok "$file: $want"
    else
      fail "$file: no \"$want\" in openssl x509 -text"
    fi
  done
}

expect ca.pem "Version: 3" "CA:TRUE" "Certificate Sign"
expect broker.pem "Version: 3" "CA:FALSE" "TLS Web Server Authentication" \
  "DNS:localhost" "IP Address:127.0.0.1" "IP Address:0:0:0:0:0:0:0:1"
expect alice.pem "Version: 3" "CA:FALSE" "TLS Web Client Authentication" "CN = alice"

for key in ca.key broker.key alice.key; do
  if openssl pkey -in "$key" -noout 2>/dev/null; then
    ok "$key: a private key"
  else
    fail "$key: not a private key"
  fi
done

verify() {
  local purpose="$1" file="$2" out
  if out="$(openssl verify -CAfile ca.pem -purpose "$purpose" "$file" 2>&1)"; then
    ok "$file: verifies against ca.pem for $purpose"
  else
    fail "$file: does not verify against ca.pem for $purpose: $out"
  fi
}
verify sslserver broker.pem
verify sslclient alice.pem

if [ "$failures" -ne 0 ]; then
  echo "check-howto-tls: $failures check(s) failed" >&2
  exit 1
fi
echo "check-howto-tls: all checks passed"
