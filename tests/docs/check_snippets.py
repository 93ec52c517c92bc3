#!/usr/bin/env python3
"""The README's code blocks marked <!-- snippet: FILE#NAME --> must be the lines of FILE
between `// [NAME]` and `// [end NAME]` (indentation removed), so that the README's code is
code that CI compiles (and, for examples/00_tour, runs).

  check_snippets.py README.md SOURCE_DIR
"""
import re
import sys
import textwrap

readme, root = sys.argv[1], sys.argv[2]
text = open(readme).read()
marks = list(re.finditer(r"<!-- snippet: (\S+)#(\S+) -->\n```[a-z]*\n(.*?)```", text, re.S))
if not marks:
    print("FAILED: no snippet marks in " + readme)
    sys.exit(1)
bad = 0
for m in marks:
    path, name, block = m.group(1), m.group(2), m.group(3)
    src = open(root + "/" + path).read()
    region = re.search(r"[ \t]*// \[%s\]\n(.*?)[ \t]*// \[end %s\]" % (re.escape(name), re.escape(name)), src, re.S)
    if not region:
        print("FAILED: %s has no region [%s]" % (path, name))
        bad += 1
        continue
    want = textwrap.dedent(region.group(1))
    if textwrap.dedent(block) != want:
        print("FAILED: README snippet %s#%s differs from the code; replace the block with:\n%s" % (path, name, want))
        bad += 1
    else:
        print("ok: %s#%s" % (path, name))
sys.exit(1 if bad else 0)
