"""Print the test ids that passed in a junit XML file (one per line): not failed, errored or skipped."""

import sys
import xml.etree.ElementTree as ET

for case in ET.parse(sys.argv[1]).iter("testcase"):
    if not any(child.tag in ("failure", "error", "skipped") for child in case):
        print(f"{case.get('classname')}::{case.get('name')}")
