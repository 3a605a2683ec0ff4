#!/usr/bin/env python3
"""Write a bench's results table into BENCHMARKS.md between its markers:

    python3 benches/markers.py NAME TABLE_FILE

replaces what lies between `<!-- NAME:begin (written by benches/NAME/run.sh) -->`
and `<!-- NAME:end -->`; without the markers, BENCHMARKS.md is left alone."""
import sys

name, table_file = sys.argv[1:3]
doc = open("BENCHMARKS.md").read()
table = open(table_file).read()
begin = f"<!-- {name}:begin (written by benches/{name}/run.sh) -->\n"
end = f"<!-- {name}:end -->"
if begin in doc and end in doc:
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    open("BENCHMARKS.md", "w").write(head + begin + table + end + tail)
    print("BENCHMARKS.md updated")
else:
    print(f"BENCHMARKS.md has no {name} markers; table left in {table_file}")
