#!/usr/bin/env bash
# Runs every test and ends with one line: "N passed, M failed[, K skipped]",
# counting test cases (gtest cases from Bazel's test.xml files, pytest cases
# from its JUnit report).
set -uo pipefail
cd "$(dirname "$0")/.."
BAZEL=${BAZEL:-bazel}
mkdir -p .tmp
rm -f .tmp/pytest.xml

$BAZEL test ${BAZEL_FLAGS:-} --test_output=errors --keep_going //...
bazel_rc=$?
testlogs=$($BAZEL info ${BAZEL_FLAGS:-} bazel-testlogs 2>/dev/null)

python3 -m pytest -q -p no:cacheprovider --junitxml=.tmp/pytest.xml tests
pytest_rc=$?

$BAZEL query ${BAZEL_FLAGS:-} 'tests(//...)' >.tmp/test_targets.txt 2>/dev/null || : >.tmp/test_targets.txt
if [[ -s .tmp/test_targets.txt ]]; then
  python3 tools/test_summary.py "$testlogs" .tmp/pytest.xml .tmp/test_targets.txt
else
  python3 tools/test_summary.py "$testlogs" .tmp/pytest.xml
fi
summary_rc=$?
if [[ $bazel_rc -ne 0 || ( $pytest_rc -ne 0 && $pytest_rc -ne 5 ) || $summary_rc -ne 0 ]]; then
  exit 1
fi
