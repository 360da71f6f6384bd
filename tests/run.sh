#!/usr/bin/env bash
# The README's test command: sets up the environment if needed, then runs the whole pytest suite.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -k format -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
. experiments/env.sh
set +e
python -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: treating as a failure" >&2; exit 1; fi
exit "$rc"
