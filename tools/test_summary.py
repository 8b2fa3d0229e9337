#!/usr/bin/env python3
"""Counts test cases in Bazel's test.xml files and a pytest JUnit report and
prints 'N passed, M failed[, K skipped]'. Exits 1 when a case failed or when
no test ran at all. With a third argument, a file of the tree's test labels
(`bazel query 'tests(//...)'`), only those targets' reports count: a target
that was removed or moved leaves its old test.xml behind in bazel-testlogs."""
import glob
import os
import sys
import xml.etree.ElementTree as ET


def count(path):
    passed = failed = skipped = 0
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError):
        return 0, 1, 0  # an unreadable report is a failed run (e.g. a crashed binary)
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.find("skipped") is not None or case.get("status") == "notrun" or \
                case.get("result") == "skipped":
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def main():
    testlogs, pytest_xml = sys.argv[1], sys.argv[2]
    totals = [0, 0, 0]
    if len(sys.argv) > 3:
        reports = []
        for label in open(sys.argv[3]).read().split():
            package, _, name = label.lstrip("/").partition(":")
            path = os.path.join(testlogs, package, name, "test.xml")
            if os.path.exists(path):
                reports.append(path)
    else:
        reports = sorted(glob.glob(os.path.join(testlogs, "**", "test.xml"), recursive=True))
    if os.path.exists(pytest_xml):
        reports.append(pytest_xml)
    for path in reports:
        for i, n in enumerate(count(path)):
            totals[i] += n
    passed, failed, skipped = totals
    line = f"{passed} passed, {failed} failed"
    if skipped:
        line += f", {skipped} skipped"
    print(line)
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
