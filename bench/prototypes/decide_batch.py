#!/usr/bin/env python3
"""A measurement prototype, not loaded by any node: does batching several
decisions into one EVALSHA make a decision cheaper for Redis?

Writes OUT.lua, the decision script (region-node/src/lua/decide.lua) run
once per call of a batch (one TIME for the batch; a call's KEYS and ARGV
copied out of the batch's), and OUT.args, B bench-plan checks of tenants in
turn per EVALSHA. Then:

    python3 bench/prototypes/decide_batch.py /tmp/batch4 4
    ROUNDS=0 scripts/script-profile /tmp/batch4.lua

prints the instructions of one EVALSHA of B decisions (divide by B), beside
`return 1` with the same arguments. BENCHMARKS.md, "Today's fields first",
has the figures: the script's work is per decision, so batching saves
little of it; only the call's fixed part is shared.
"""
import pathlib
import sys

out, batch = sys.argv[1], int(sys.argv[2])
root = pathlib.Path(__file__).resolve().parents[2]
src = (root / "region-node/src/lua/decide.lua").read_text()
head, rest = src.split("local t = redis.call('TIME')\n", 1)
head = head.replace("local A = ARGV\n", "")
numbers = head.index("local deadline, node_day")
body = head[numbers:] + "local t = T\n" + rest
script = (
    head[:numbers]
    + "local function decide(KEYS, A, T)\n"
    + body
    + """
end

local T = redis.call('TIME')
local B, pos = unpack_n('<d', ARGV[1])
local out = {}
local ko, ao = 0, 1
for b = 1, B do
  local nk, na
  nk, na, pos = unpack_n('<dd', ARGV[1], pos)
  local keys, args = {}, {}
  for i = 1, nk do keys[i] = KEYS[ko + i] end
  for i = 1, na do args[i] = ARGV[ao + i] end
  out[b] = decide(keys, args, T)
  ko = ko + nk; ao = ao + na
end
return out
"""
)
pathlib.Path(out + ".lua").write_text(script)
# One call's words: the bench plan's full check, as
# tests/fixtures/decide_previous_release.args has them (same layout).
words = (root / "tests/fixtures/decide_previous_release.args").read_text().split()
pathlib.Path(out + ".args").write_text(f"BATCH:{batch} " + " ".join(words) + "\n")
