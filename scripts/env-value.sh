#!/usr/bin/env bash
# Print NAME's value in a KEY=VALUE file with compose's .env syntax (the last
# assignment wins; nothing when NAME is not set there):
#
#   scripts/env-value.sh FILE NAME
#
# For the Makefile, which reads .env before any venv exists (pdstack.config
# reads the same files with python-dotenv; tests/test_makefile.py checks the
# two agree). Handled: `export ` prefixes, spaces around `=`, single-quoted
# (literal) and double-quoted values, unquoted values with ` #` comments.
set -euo pipefail
file=$1 name=$2
[ -r "$file" ] || exit 0
awk -v name="$name" '
  {
    line = $0
    sub(/^[ \t]*(export[ \t]+)?/, "", line)
    if (index(line, name) != 1) next
    rest = substr(line, length(name) + 1)
    if (rest !~ /^[ \t]*=/) next
    sub(/^[ \t]*=[ \t]*/, "", rest)
    q = substr(rest, 1, 1)
    if (q == "\"" || q == "'"'"'") {
      end = index(substr(rest, 2), q)
      value = end ? substr(rest, 2, end - 1) : substr(rest, 2)
    } else {
      sub(/[ \t]+#.*$/, "", rest)
      sub(/[ \t]+$/, "", rest)
      value = rest
    }
    found = 1
  }
  END { if (found) print value }
' "$file"
