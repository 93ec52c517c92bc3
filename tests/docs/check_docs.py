#!/usr/bin/env python3
"""The docs as a newcomer meets them: README.md is a landing page of at most 300 lines whose
first command (launch/quickstart) comes within its first 40 lines, and no link in README.md,
docs/, bench/README.md or studies/README.md points to a file that does not exist, or to a
heading (#anchor, as GitHub names them) that a Markdown page does not have.

  check_docs.py SOURCE_DIR
"""
import os
import re
import sys

root = sys.argv[1]
MAX_README_LINES, FIRST_COMMAND_BY = 300, 40
bad = []

readme = open(os.path.join(root, "README.md")).read().splitlines()
if len(readme) > MAX_README_LINES:
    bad.append("README.md has %d lines, more than %d: move the detail into docs/" % (len(readme), MAX_README_LINES))
first = next((i + 1 for i, line in enumerate(readme) if line.startswith("launch/quickstart ")), None)
if first is None or first > FIRST_COMMAND_BY:
    bad.append("README.md: the first command (launch/quickstart ...) is at line %s, not within the first %d"
               % (first, FIRST_COMMAND_BY))

pages = ["README.md", "bench/README.md", "studies/README.md"]
for folder, _, files in os.walk(os.path.join(root, "docs")):
    pages += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files) if f.endswith(".md")]
if not any(p.startswith("docs" + os.sep) for p in pages):
    bad.append("docs/ has no pages")

def anchors(path):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    names, seen = set(), {}
    for heading in re.findall(r"^#+ +(.*?) *$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        names.add(slug if n == 0 else "%s-%d" % (slug, n))
    return names


link = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
checked = 0
for page in pages:
    path = os.path.join(root, page)
    if not os.path.exists(path):
        bad.append("%s does not exist" % page)
        continue
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)  # code blocks hold no links
    for number, line in enumerate(text.splitlines(), 1):
        for target in link.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            if target.startswith("#"):
                target = os.path.basename(page) + target  # an anchor in the same page
            checked += 1
            file, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file))
            if not os.path.exists(resolved):
                bad.append("%s: a link to %s, which does not exist" % (page, target))
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                bad.append("%s: a link to %s, whose page has no heading #%s" % (page, target, anchor))

for b in bad:
    print("FAILED: " + b)
if not bad:
    print("ok: README.md %d lines, first command at line %d; %d links in %d pages resolve"
          % (len(readme), first, checked, len(pages)))
sys.exit(1 if bad else 0)
