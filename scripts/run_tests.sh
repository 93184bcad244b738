#!/usr/bin/env bash
# Runs the test suite. pytest's exit code 5 ("no tests were collected") is reported as its own failure:
# a test command that ran nothing has checked nothing.
set -u
py="${1:-.venv/bin/python}"
shift || true
"$py" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests (exit 5) — treating as a broken test command" >&2
fi
exit "$rc"
