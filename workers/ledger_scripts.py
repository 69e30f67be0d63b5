"""The Lua scripts the request ledger runs in Redis (workers/ledger.py): each reads and
changes a request's keys in one step, so two workers never interleave on them."""

# KEYS: done, lease, attempt, cancel, reply, final, another cancel (its batch's, or the
# cancel again), arrival. ARGV: owner, lease ms, attempt ttl s, this call's token.
ARRIVE = """
local function arrived(attempt)
  local cancelled = redis.call('EXISTS', KEYS[4], KEYS[7])
  return {'ok', attempt, cancelled, redis.call('LRANGE', KEYS[5], 0, -1)}
end
local function again()  -- this call, sent again: its first answer was lost
  return redis.call('GET', KEYS[8]) == ARGV[4]
end
local function lease()
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[8], ARGV[4], 'PX', ARGV[2])
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local final = redis.call('GET', KEYS[6])
  if final and redis.call('EXISTS', KEYS[2]) == 1 then  -- a worker is delivering it
    if again() then return {'done', final} end
    return {'busy', redis.call('PTTL', KEYS[2])}
  end
  if final then lease() end  -- its worker died before delivering it: this caller does, alone
  return {'done', final}
end
if redis.call('EXISTS', KEYS[2]) == 1 then  -- its own earlier task too: one at a time
  if again() then return arrived(tonumber(redis.call('GET', KEYS[3])) or 1) end
  return {'busy', redis.call('PTTL', KEYS[2])}
end
lease()
local attempt = redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
return arrived(attempt)
"""
# Whether the lease (KEYS[1]) is ARGV[1]'s: it names it, or it lapsed and nobody took
# the request since: not done (KEYS[2]) and no later attempt (KEYS[3] against ARGV[2]);
# then it is taken again for ARGV[3] ms. (FINISH also takes back a done one whose stored
# final is the caller's, and DONE_LATE marks a done one nobody holds under the caller's
# attempt: UNCLAIMED below.)
HELD = """
local function held()
  local holder = redis.call('GET', KEYS[1])
  if holder then return holder == ARGV[1] end
  if redis.call('EXISTS', KEYS[2]) == 1 then return false end
  local attempt = redis.call('GET', KEYS[3])
  if attempt and tonumber(attempt) ~= tonumber(ARGV[2]) then return false end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return true
end
"""


def held_then(body: str, refused: str = "0") -> str:
    """A script that runs `body` only while the lease is ARGV[1]'s, else returns `refused`."""
    return f"{HELD}\nif not held() then return {refused} end\n{body}"


# KEYS: lease, done, attempt, reply. ARGV: owner, attempt, lease ms, seq, entry, reply ttl
# s, the unknown-text marker (a restart's first entry replaces it: it has begun too).
RECORD = held_then(
    """
local length = redis.call('LLEN', KEYS[4])
if tonumber(ARGV[4]) == 0 and length == 1 and redis.call('LINDEX', KEYS[4], 0) == ARGV[7] then
  redis.call('DEL', KEYS[4])
  length = 0
end
if length == tonumber(ARGV[4]) + 1 and redis.call('LINDEX', KEYS[4], -1) == ARGV[5] then
  return 1  -- this entry again: its answer was lost to a dropped connection
end
if length ~= tonumber(ARGV[4]) then return -2 end
redis.call('RPUSH', KEYS[4], ARGV[5])
redis.call('EXPIRE', KEYS[4], ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
""",
    refused="-1",
)

# The lease lapsed and nobody took the request since: no holder, no later attempt than
# ARGV[2]. Where the request is done, HELD answers "another's": it may be the caller's
# own FINISH, which ran while its answer was lost (Redis away past the lease after it).
UNCLAIMED = """
local function unclaimed()
  return redis.call('EXISTS', KEYS[1]) == 0
    and tonumber(redis.call('GET', KEYS[3]) or ARGV[2]) == tonumber(ARGV[2])
end
"""

# KEYS: lease, done, attempt, final, reply. ARGV: owner, attempt, lease ms, final, done
# ttl s, final ttl s. Sent again, its own final found unclaimed, it is the caller's still;
# found done by itself under its lease, it writes nothing (delivered since, maybe). Its
# done mark names the attempt: the gateway's withdrawal ('0') is answered as before.
FINISH = f"""{HELD}{UNCLAIMED}
local finished = 'finished ' .. ARGV[2]
if unclaimed() and redis.call('GET', KEYS[4]) == ARGV[4] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
if not held() then return 0 end
if redis.call('GET', KEYS[2]) == finished then return 1 end
redis.call('SET', KEYS[2], finished, 'EX', ARGV[5])
redis.call('SET', KEYS[4], ARGV[4], 'EX', ARGV[6])
redis.call('DEL', KEYS[5])
return 1
"""

# A reply whose final and usage went out while Redis was out of reach, once it answers:
# done, its transcript and any final (a FINISH that ran, its answer lost) dropped, and
# the lease given back. 2: done already (marked before, answered by another worker, or
# left unclaimed under this attempt: a FINISH of it ran unanswered and the lease lapsed;
# the final stored then is dropped too, as the caller's final is out).
# Not under a later attempt numbered otherwise (HELD asks the owner alone): defence in
# depth behind the worker's own check (RequestLedger.arrive skips what it owes a mark)
# and the per-process owner. KEYS: lease, done, attempt, reply, final.
# ARGV: owner, attempt, lease ms, done ttl s.
DONE_LATE = f"""{HELD}{UNCLAIMED}
local function mark()
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[4])
  redis.call('DEL', KEYS[4], KEYS[5], KEYS[1])
end
if tonumber(redis.call('GET', KEYS[3]) or ARGV[2]) == tonumber(ARGV[2]) then
  if held() then mark() return 1 end
  if unclaimed() then mark() return 2 end
end
return redis.call('EXISTS', KEYS[2]) * 2
"""

# KEYS: lease, done, attempt, reply. ARGV: owner, attempt, lease ms, marker ('' for
# none), reply ttl s. Only its holder drops a transcript: a worker whose lease lapsed
# while Redis stalled would drop the one the worker that took over is writing.
FORGET = held_then(
    """
redis.call('DEL', KEYS[4])
if ARGV[4] ~= '' then
  redis.call('RPUSH', KEYS[4], ARGV[4])
  redis.call('EXPIRE', KEYS[4], ARGV[5])
end
return 1
"""
)

# KEYS: lease, done, attempt. ARGV: owner, attempt, lease ms.
RENEW = held_then(
    """
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# A first attempt taken while Redis did not answer, once it does. KEYS: lease, done,
# attempt. ARGV: owner, 1, lease ms, attempt ttl s.
LATE = held_then(
    """
redis.call('SET', KEYS[3], ARGV[2], 'NX', 'EX', ARGV[4])
return 1
"""
)

# KEYS: lease. ARGV: owner.
RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""
