"""After the stacks ran in parallel (their output interleaved), one line per stack and the totals, from the JUnit
XML each stack's pytest wrote (tox.ini): ``python .ci/summary.py .tox``."""

import glob
import os
import sys
import xml.etree.ElementTree as ET


def main(toxworkdir: str) -> None:
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for path in sorted(glob.glob(os.path.join(toxworkdir, "junit-*.xml"))):
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
        failed = int(suite.get("failures")) + int(suite.get("errors"))
        passed = tests - skipped - failed
        env = os.path.basename(path)[len("junit-"):-len(".xml")]
        print(f"[summary {env}] {passed} passed, {failed} failed, {skipped} skipped in {float(suite.get('time')):.0f} s")
        for key, n in (("passed", passed), ("failed", failed), ("skipped", skipped)):
            totals[key] += n
    print(f"all stacks: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".tox")
