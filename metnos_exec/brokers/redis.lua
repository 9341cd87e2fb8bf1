-- The Redis broker's scripts (metnos_exec/brokers/redis.py). Each section below is one
-- script; redis.py prepends the prelude to every one and loads them with SCRIPT LOAD
-- (EVALSHA, reloaded after a restart). Every multi-key step is one script, so it is
-- atomic: no other client sees a job half-leased, half-settled or half-queued.
--
-- The key layout is documented in queue/README.md ("Redis"); the names are built in the
-- prelude from redis.py's `KEY_NAMES` (a test keeps the README's table to the keys Redis
-- really holds). All keys share the prefix's hash tag, so on a Redis Cluster every
-- script's keys live in one slot.
--
-- Conventions: ARGV[1] is the key prefix (with its hash tag, e.g. "{metnos}:"), ARGV[2]
-- the broker clock's time in unix seconds ('' = this server's TIME, one clock for every
-- worker of a fleet). Times go in and out as strings formatted with %.17g: Redis turns a
-- Lua number into a reply or an argument with 14 significant digits, which would round a
-- lease deadline by up to 0.1 ms.

-- == prelude ==
local P = ARGV[1]
local NOW
if ARGV[2] ~= '' then
  NOW = tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
-- The names come from redis.py (`KEY_NAMES`), put in for the dollar placeholders when it
-- loads this file: one table of key names for the code and the scripts.
local GROUP = '$group'
local COUNTS = P .. '$counts'
local DELAYED = P .. '$delayed'
local FINISHED = P .. '$finished'
local EXPIRING = P .. '$expiring'
local DEAD = P .. '$dead'
local INBOX = P .. '$inbox'
local DEVICES = P .. '$devices'
local WAKE = P .. '$wake'

local function num(x) return string.format('%.17g', x) end
local function jkey(id) return P .. '$job' .. id end
-- A route is where a queued job waits: its priority and executor ('<prio>:<executor>'),
-- one stream per device and route, so that a worker reads only the executors it serves.
-- A bare '<prio>' is a route of a build before routing (any worker reads it).
local function qkey(dev, rt) return P .. '$stream' .. dev .. ':' .. rt end
local function route_prio(rt) return tonumber(string.match(rt, '^(%-?%d+)')) end
local function route_exec(rt) return string.match(rt, '^%-?%d+:(.+)$') end
local function prios_key(dev) return P .. '$priorities' .. dev end
local function leases_key(dev) return P .. '$leases' .. dev end
local function idem_key(k) return P .. '$idempotency' .. k end
local function undo_key(e) return P .. '$undo' .. e end
local function job_undos_key(id) return P .. '$job_undos' .. id end
local UNDO_AT = P .. '$undo_at'
local BLOBS = P .. '$blobs'

-- The guard. A script is not a transaction: one that fails halfway keeps what it changed
-- before (a producer's SET on the inbox made every lease fail after it had taken jobs,
-- which then lapsed with their attempts spent). So the keys a script relies on are
-- checked before it changes anything: a key of another type, a counter or a priority
-- that is not a number stops the script at once, unchanged, with an error naming it
-- (METNOS_BADKEY|<problem>|<key>|). The client sets the key aside (`set_aside`: renamed
-- or repaired, its content kept as evidence), says so once and calls again. A job's own
-- hash of another type reads as no job (`hm`); a blob count that is not a number is
-- repaired where it is counted.
local function bad_key(key, problem)
  error({err = 'METNOS_BADKEY|' .. problem .. '|' .. key .. '|'})
end
local function expect(key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then bad_key(key, 'type=' .. t .. ',expected=' .. want) end
end
local function is_int(v) return v ~= nil and string.match(v, '^%-?%d+$') ~= nil end
local function is_route(v) return is_int(v) or string.match(v, '^%-?%d+:.') ~= nil end
if SCRIPT ~= 'set_aside' then
  expect(COUNTS, 'hash')
  expect(DELAYED, 'zset')
  expect(FINISHED, 'zset')
  expect(EXPIRING, 'zset')
  expect(DEAD, 'zset')
  expect(INBOX, 'stream')
  expect(DEVICES, 'set')
  expect(UNDO_AT, 'zset')
  expect(BLOBS, 'hash')
  local c = redis.call('HGETALL', COUNTS)
  for i = 2, #c, 2 do
    if not is_int(c[i]) then bad_key(COUNTS, 'field=' .. c[i - 1]) end
  end
end
-- A device's keys: its leases, its routes (a priority, and an executor) and their
-- streams; `prios` are routes about to be used (a stream a producer made by hand there).
local checked_devices = {}
local function check_device(dev, prios)
  if not checked_devices[dev] then
    checked_devices[dev] = true
    expect(P .. '$leases' .. dev, 'zset')
    local pk = P .. '$priorities' .. dev
    expect(pk, 'zset')
    for _, prio in ipairs(redis.call('ZRANGE', pk, 0, -1)) do
      if not is_route(prio) then bad_key(pk, 'member=' .. prio) end
      expect(P .. '$stream' .. dev .. ':' .. prio, 'stream')
    end
  end
  for _, prio in ipairs(prios or {}) do expect(P .. '$stream' .. dev .. ':' .. prio, 'stream') end
end
-- HMGET of a job's hash; a key of another type there (written by hand) is no job.
local function hm(key, ...)
  local r = redis.pcall('HMGET', key, ...)
  if type(r) == 'table' and r.err then return {} end
  return r
end
-- The device keys of the jobs ARGV[from], ARGV[from + step], ... (before they change).
local function check_jobs(from, step)
  for i = from, #ARGV, step do
    local h = hm(P .. '$job' .. ARGV[i], 'device', 'priority', 'route')
    if h[1] then check_device(h[1], {h[3] or h[2]}) end
  end
end

-- Count (or uncount, n = -1) the blobs an undo entry needs: `blobs` is the entry's
-- space-separated digests; a digest no entry needs any more leaves the table.
local function count_blobs(blobs, n)
  for digest in string.gmatch(blobs or '', '%S+') do
    local left = redis.pcall('HINCRBY', BLOBS, digest, n)
    if type(left) == 'table' then  -- not a number (written by hand): counted afresh
      left = math.max(n, 0)
      redis.call('HSET', BLOBS, digest, left)
    end
    if left <= 0 then redis.call('HDEL', BLOBS, digest) end
  end
end

-- Forget one undo entry (its blobs uncounted).
local function drop_undo(e)
  local h = hm(undo_key(e), 'blobs', 'job_id')
  if h[2] then
    count_blobs(h[1], -1)
    redis.call('SREM', job_undos_key(h[2]), e)
  end
  redis.call('DEL', undo_key(e))
  redis.call('ZREM', UNDO_AT, e)
end

-- The wake-up stream (issue 22): one entry per route a script made work ready on (the
-- device `d`, the executor `e`), so that idle workers blocked on it (`XREAD BLOCK`, the
-- cursor their last lease returned) look at once instead of at their next poll. Capped:
-- a wake-up is a hint, a worker that missed one still looks at its next timeout. Written
-- with pcall: a key a producer spoiled there costs a wake-up, never a job's step.
local woken = {}
local function wake(dev, rt)
  local at = dev .. ' ' .. rt
  if woken[at] then return end
  woken[at] = true
  redis.pcall('XADD', WAKE, 'MAXLEN', '~', 1000, '*', 'd', dev, 'e', route_exec(rt) or '')
end

-- Append the job to its device's stream for its route (created with its consumer group
-- on first use, and listed in the device's routes, scored by priority).
local function enqueue(id, dev, rt)
  local q = qkey(dev, rt)
  local prio = route_prio(rt)
  if redis.call('EXISTS', q) == 0 then
    redis.call('XGROUP', 'CREATE', q, GROUP, '0', 'MKSTREAM')
    redis.call('ZADD', prios_key(dev), prio, rt)
    redis.call('SADD', DEVICES, dev)
  elseif not redis.call('ZSCORE', prios_key(dev), rt) then
    -- A stream we did not make (a producer writing past the inbox): without our group
    -- and its priority listed, nothing queued here would ever be leased. Its stray
    -- entries are read as stale and dropped. (BUSYGROUP: the group is there already.)
    redis.pcall('XGROUP', 'CREATE', q, GROUP, '0')
    redis.call('ZADD', prios_key(dev), prio, rt)
  end
  -- `n`, the queue's enqueue count, orders entries of different streams (their ids
  -- may tie within one millisecond): oldest first across the executors a worker serves.
  local n = redis.call('HINCRBY', COUNTS, 'enqueued', 1)
  local eid = redis.call('XADD', q, '*', 'id', id, 'n', n)
  redis.call('HSET', jkey(id), 'entry', eid)
  wake(dev, rt)
end

-- Take the job's entry out of its stream: acked (out of the pending-entries list) and
-- deleted, so a stream holds only queued and running jobs and never grows with history.
local function unqueue(jk)
  local h = hm(jk, 'entry', 'device', 'priority', 'route')
  if h[1] then
    local q = qkey(h[2], h[4] or h[3])
    redis.call('XACK', q, GROUP, h[1])
    redis.call('XDEL', q, h[1])
    redis.call('HDEL', jk, 'entry')
  end
end

-- The caller's lease is the current one.
local function holds(jk, token)
  local h = hm(jk, 'state', 'token')
  return h[1] == 'running' and h[2] == token
end

-- A settle call sent again after a call for the same token failed with the outcome
-- unknown (replay = '1': the connection dropped, the first try may have been carried
-- out): that try's outcome, so the resend reports what really happened.
local function replayed(jk, token, replay)
  if replay ~= '1' then return nil end
  local prev = hm(jk, 'prev')[1]
  if prev and string.sub(prev, 1, #token + 1) == token .. ' ' then
    return string.sub(prev, #token + 2)
  end
  return nil
end

-- The job's result_ttl_s, when its body gives one (a search for a number first: only
-- such a body is decoded, not one with "result_ttl_s":null as the Python side writes).
local function result_ttl(body)
  if not body or not string.match(body, '"result_ttl_s"%s*:%s*%d') then return nil end
  local ok, doc = pcall(cjson.decode, body)
  local ttl = ok and type(doc) == 'table' and doc.result_ttl_s
  if type(ttl) == 'number' and ttl > 0 then return ttl end
  return nil
end

-- A job reaches its end (done, or dead): out of its stream and the leases, result
-- stored, counted, listed for retention (and among the dead letters; with a
-- result_ttl_s, by when it may go).
local function finish(id, state, result, letter, from, token, outcome)
  local jk = jkey(id)
  local ttl = result_ttl(hm(jk, 'body')[1])
  if ttl then redis.call('ZADD', EXPIRING, num(NOW + ttl), id) end
  unqueue(jk)
  redis.call('ZREM', leases_key(hm(jk, 'device')[1] or ''), id)
  redis.call('HSET', jk, 'state', state, 'result', result, 'done_at', num(NOW))
  redis.call('HDEL', jk, 'token', 'lease_until')
  if token then redis.call('HSET', jk, 'prev', token .. ' ' .. outcome) end
  redis.call('ZADD', FINISHED, num(NOW), id)
  if letter then
    redis.call('HSET', jk, 'letter', letter)
    redis.call('ZADD', DEAD, num(NOW), id)
  end
  redis.call('HINCRBY', COUNTS, from, -1)
  redis.call('HINCRBY', COUNTS, state, 1)
  -- A client waits for this result (`await_result` marked the job): its blocked read on
  -- done:<id> returns now. The key goes by itself; pcall as for `wake`.
  if hm(jk, 'waiter')[1] then
    redis.call('HDEL', jk, 'waiter')
    local dk = P .. '$done' .. id
    redis.pcall('XADD', dk, '*', 'state', state)
    redis.pcall('PEXPIRE', dk, 60000)
  end
end

-- Queue one job unless its id or idempotency key is known. Returns the status, the id
-- that stands, and (for a known key) the original's body, for the caller's conflict check.
local function admit(id, body, dev, prio, maxa, ikey, nb, exec)
  local jk = jkey(id)
  if redis.call('EXISTS', jk) == 1 then return {'dup', id, hm(jk, 'body')[1] or ''} end
  if ikey ~= '' then
    local orig = redis.call('GET', idem_key(ikey))
    if orig then return {'dup', orig, hm(jkey(orig), 'body')[1] or ''} end
    redis.call('SET', idem_key(ikey), id)
  end
  local rt = prio
  if exec ~= '' then rt = prio .. ':' .. exec end
  redis.call('HSET', jk, 'body', body, 'state', 'queued', 'device', dev, 'priority', prio,
    'max_attempts', maxa, 'attempt', 0, 'ikey', ikey, 'route', rt)
  redis.call('HINCRBY', COUNTS, 'queued', 1)
  local due = tonumber(nb)
  if due and due > NOW then
    redis.call('ZADD', DELAYED, nb, id)
  else
    enqueue(id, dev, rt)
  end
  return {'new', id, ''}
end

-- == submit ==
-- ARGV[3..]: groups of (id, body, device, priority, max_attempts, idempotency key or '',
-- not_before or '', executor). Returns one {status, id, original body} per job.
local function route_of(prio, exec)
  if exec == '' then return prio end
  return prio .. ':' .. exec
end
for i = 3, #ARGV, 8 do check_device(ARGV[i + 2], {route_of(ARGV[i + 3], ARGV[i + 7])}) end
local out = {}
for i = 3, #ARGV, 8 do
  out[#out + 1] = admit(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4],
    ARGV[i + 5], ARGV[i + 6], ARGV[i + 7])
end
return out

-- == admit_inbox ==
-- Entries of the inbox stream, decoded and checked by the worker. ARGV[3..]: groups of
-- 10: (entry id, 'job', id, body, device, priority, max_attempts, ikey, not_before,
-- executor) or (entry id, 'bad', id, raw, result, letter, '', '', '', ''). An entry
-- another worker already took (XDEL finds nothing) is skipped, so each is admitted once.
for i = 3, #ARGV, 10 do
  if ARGV[i + 1] == 'job' then
    local rt = ARGV[i + 5]
    if ARGV[i + 9] ~= '' then rt = rt .. ':' .. ARGV[i + 9] end
    check_device(ARGV[i + 4], {rt})
  end
end
check_device('server')
local n = 0
for i = 3, #ARGV, 10 do
  if redis.call('XDEL', INBOX, ARGV[i]) == 1 then
    n = n + 1
    local id = ARGV[i + 2]
    if ARGV[i + 1] == 'job' then
      admit(id, ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7], ARGV[i + 8],
        ARGV[i + 9])
    elseif redis.call('EXISTS', jkey(id)) == 0 then
      redis.call('HSET', jkey(id), 'body', ARGV[i + 3], 'state', 'queued', 'device', 'server',
        'attempt', 0, 'max_attempts', 1)
      redis.call('HINCRBY', COUNTS, 'queued', 1)
      finish(id, 'dead', ARGV[i + 4], ARGV[i + 5], 'queued', nil, nil)
    end
  end
end
return n

-- == inbox_trim ==
-- ARGV[3] the most bytes an entry may have, [4] how many of an oversized entry's `job`
-- to keep, [5] how many entries to look at. An inbox entry over the bound (a producer's
-- 50 MB mistake) is replaced by one holding an excerpt, the original size (`oversize`)
-- and its `id` cut to 256 characters, so that no worker reads it whole and no dead
-- letter keeps it whole. Returns how many were replaced.
local max, keep = tonumber(ARGV[3]), tonumber(ARGV[4])
local n = 0
for _, e in ipairs(redis.call('XRANGE', INBOX, '-', '+', 'COUNT', tonumber(ARGV[5]))) do
  local f = e[2]
  local size = 0
  for i = 1, #f do size = size + #f[i] end
  if size > max then
    local out = {'oversize', tostring(size)}
    for i = 1, #f - 1, 2 do
      if f[i] == 'id' then
        out[#out + 1] = 'id'
        out[#out + 1] = string.sub(f[i + 1], 1, 256)
      elseif f[i] == 'job' then
        out[#out + 1] = 'job'
        out[#out + 1] = string.sub(f[i + 1], 1, keep)
      end
    end
    redis.call('XDEL', INBOX, e[1])
    redis.call('XADD', INBOX, '*', unpack(out))
    n = n + 1
  end
end
return n

-- == lease ==
-- ARGV[3] worker id, [4] visibility seconds, [5] device, [6] limit, [7] token base,
-- [8] how many of the leases handed out start at once (the rest are leased ahead: they
-- count as an attempt only once `mark_started`), [9] the unstarted-lapse cap, [10..] the
-- executors the worker serves ('*': all of them; none: only the routes of older builds).
-- Returns {now, inbox length, leases, finals, lease_until}: leases are {id, body, attempt,
-- token}; finals are lapsed leases with no delivery left (or a cancel pending) that this
-- worker must now settle, {id, body, attempt, token, last worker, cancel flag, started
-- flag, lapses}, under a short lease of their own (a worker dying meanwhile leaves them
-- to the next sweep).
local worker, dev = ARGV[3], ARGV[5]
local limit, base = tonumber(ARGV[6]), ARGV[7]
local start_n, max_lapses = tonumber(ARGV[8]), tonumber(ARGV[9])
local until_ = num(NOW + tonumber(ARGV[4]))
local lk = leases_key(dev)
local out, finals = {}, {}
local served = nil
if ARGV[10] ~= '*' then
  served = {}
  for i = 10, #ARGV do served[ARGV[i]] = true end
end
-- Whether this worker reads a route: a route of an older build names no executor.
local function serves(rt)
  if not served then return true end
  local e = route_exec(rt)
  return e == nil or served[e] == true
end
local k = 0
local function token()
  k = k + 1
  return base .. '.' .. k
end
local function take(id, jk, body, was_queued)
  local tok = token()
  local attempt = redis.call('HINCRBY', jk, 'attempt', 1)
  local started = '0'
  if #out < start_n then started = '1' end
  redis.call('HSET', jk, 'state', 'running', 'token', tok, 'lease_until', until_,
    'worker', worker, 'started', started)
  redis.call('ZADD', lk, until_, id)
  if was_queued then
    redis.call('HINCRBY', COUNTS, 'queued', -1)
    redis.call('HINCRBY', COUNTS, 'running', 1)
  end
  out[#out + 1] = {id, body, tostring(attempt), tok}
end

-- 0. Every key this call may change, checked before it changes any (the guard).
check_device(dev)
local due = redis.call('ZRANGEBYSCORE', DELAYED, '-inf', num(NOW), 'LIMIT', 0, 1000)
local due_jobs = {}
for _, id in ipairs(due) do
  local h = hm(jkey(id), 'device', 'priority', 'state', 'route')
  h[4] = h[4] or h[2]
  due_jobs[id] = h
  if h[3] == 'queued' then check_device(h[1], {h[4]}) end
end

-- 1. Delayed jobs (not_before, retry backoff) that fell due join their streams.
for _, id in ipairs(due) do
  redis.call('ZREM', DELAYED, id)
  local h = due_jobs[id]
  if h[3] == 'queued' then enqueue(id, h[1], h[4]) end
end

-- 2. Lapsed leases of this device (their workers stopped heart-beating): taken over
-- with XCLAIM, which moves the pending entry to this consumer and counts a delivery.
-- Only those of executors this worker serves are taken over; any worker settles a final.
local lapsed = redis.call('ZRANGEBYSCORE', lk, '-inf', num(NOW), 'LIMIT', 0, limit + 256)
-- A lease that never started (a job leased ahead, its worker lost before launching it)
-- gives its attempt back and counts a lapse instead; only started ones use attempts.
for _, id in ipairs(lapsed) do
  local jk = jkey(id)
  local h = hm(jk, 'state', 'attempt', 'max_attempts', 'cancel', 'entry',
    'priority', 'body', 'worker', 'started', 'lapses', 'route')
  local rt = h[11] or h[6]
  if h[1] ~= 'running' then
    redis.call('ZREM', lk, id)
  else
    local attempt = tonumber(h[2])
    local started = h[9] ~= '0'  -- absent (a job leased by an older build): started
    local lapses = tonumber(h[10] or '0')
    local final
    if h[4] == '1' then
      final = true
    elseif started then
      final = attempt >= tonumber(h[3])
    else
      final = lapses + 1 >= max_lapses
    end
    local function give_back()
      if not started then
        attempt = math.max(attempt - 1, 0)
        lapses = lapses + 1
        redis.call('HSET', jk, 'attempt', attempt, 'lapses', lapses, 'started', '1')
      end
    end
    if final then
      give_back()
      local tok = token()
      redis.call('HSET', jk, 'token', tok, 'lease_until', until_)
      redis.call('ZADD', lk, until_, id)
      local sflag = '0'
      if started then sflag = '1' end
      finals[#finals + 1] = {id, h[7], tostring(attempt), tok, h[8] or '', h[4] or '',
        sflag, tostring(lapses)}
    elseif #out < limit and serves(rt) then
      give_back()
      if h[5] then redis.call('XCLAIM', qkey(dev, rt), GROUP, worker, 0, h[5]) end
      take(id, jk, h[7], false)
    end
  end
end

-- 3. New work, highest priority first, oldest first within one priority (across the
-- executors served: their streams' next entries compared by their enqueue count).
local pk = prios_key(dev)
-- Read up to n entries of one route's stream; how many it returned (0: none left, and a
-- stream with no entry at all, none queued, none running, goes with its group, so idle
-- routes leave no keys behind).
local function forget(rt)
  redis.call('DEL', qkey(dev, rt))
  redis.call('ZREM', pk, rt)
  if redis.call('ZCARD', pk) == 0 then redis.call('SREM', DEVICES, dev) end
end
local function read(rt, n)
  local q = qkey(dev, rt)
  local res = redis.call('XREADGROUP', 'GROUP', GROUP, worker, 'COUNT', n, 'STREAMS', q, '>')
  if not res then
    if redis.call('XLEN', q) == 0 then forget(rt) end
    return 0
  end
  for _, entry in ipairs(res[1][2]) do
    local eid, id = entry[1], entry[2][2]
    local jk = jkey(id)
    local h = hm(jk, 'state', 'entry', 'body')
    if h[1] == 'queued' and h[2] == eid then
      take(id, jk, h[3], true)
    else
      -- A stale entry (its job was cancelled, purged or queued again elsewhere).
      redis.call('XACK', q, GROUP, eid)
      redis.call('XDEL', q, eid)
    end
  end
  return #res[1][2]
end
-- The next n entries of a route no consumer has read yet (peeked, not taken), as
-- {enqueue count, route}.
local function peek(rt, n)
  local q = qkey(dev, rt)
  -- A route listed with no stream (deleted since it was listed) has nothing to read:
  -- XINFO on it is an error, which after this script's reads left their entries pending.
  if redis.call('EXISTS', q) == 0 then
    forget(rt)
    return {}
  end
  local last = '0-0'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', q)) do
    local name, lid
    for j = 1, #g - 1, 2 do
      if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then lid = g[j + 1] end
    end
    if name == GROUP then last = lid end
  end
  local ids = {}
  for _, e in ipairs(redis.call('XRANGE', q, '(' .. last, '+', 'COUNT', n)) do
    local f = e[2]
    local seq = 0  -- an entry without one (stray, or an older build's) goes first
    for j = 1, #f - 1, 2 do
      if f[j] == 'n' then seq = tonumber(f[j + 1]) or 0 end
    end
    ids[#ids + 1] = {seq, rt}
  end
  if #ids == 0 and redis.call('XLEN', q) == 0 then forget(rt) end
  return ids
end
local function older(a, b) return a[1] < b[1] end
local routes = {}
if #out < limit then routes = redis.call('ZREVRANGE', pk, 0, -1, 'WITHSCORES') end
-- (Listed for `queued_routes`; a queue an older build made has its devices listed here.)
if #routes > 0 then redis.call('SADD', DEVICES, dev) end
local i = 1
while i <= #routes and #out < limit do
  local score, group = routes[i + 1], {}
  while i <= #routes and routes[i + 1] == score do
    if serves(routes[i]) then group[#group + 1] = routes[i] end
    i = i + 2
  end
  if #group == 1 then
    while #out < limit and read(group[1], limit - #out) > 0 do end
  elseif #group > 1 then
    while #out < limit do
      local need, heads = limit - #out, {}
      for _, rt in ipairs(group) do
        for _, head in ipairs(peek(rt, need)) do heads[#heads + 1] = head end
      end
      if #heads == 0 then break end
      table.sort(heads, older)
      -- Taken in that order, a run of one route's entries in one read.
      local j, last = 1, math.min(need, #heads)
      while j <= last do
        local run = j
        while run < last and heads[run + 1][2] == heads[j][2] do run = run + 1 end
        read(heads[j][2], run - j + 1)
        j = run + 1
      end
    end
  end
end
-- Where an idle wait starts (`wait_for_work`): the last wake-up and inbox entries (any
-- newer one is work this call did not see), and how long until a delayed job falls due
-- or a lease of this device may lapse ('' for neither), on this call's clock.
local function last_id(key)
  local r = redis.pcall('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if type(r) == 'table' and r[1] then return r[1][1] end
  return '0-0'
end
local nxt = nil
for _, zk in ipairs({DELAYED, lk}) do
  -- Strictly after now: a lapsed lease of an executor this worker does not serve stays
  -- there past its deadline, and must not make every wait end at once.
  local first = redis.call('ZRANGEBYSCORE', zk, '(' .. num(NOW), '+inf', 'WITHSCORES',
    'LIMIT', 0, 1)
  if first[2] and (not nxt or tonumber(first[2]) < nxt) then nxt = tonumber(first[2]) end
end
local next_in = ''
if nxt then next_in = num(math.max(0, nxt - NOW)) end
return {num(NOW), tostring(redis.call('XLEN', INBOX)), out, finals, until_,
  last_id(WAKE), last_id(INBOX), next_in}

-- == mark_started ==
-- ARGV[3..]: pairs of (id, token). For each lease still current: its delivery starts
-- now and counts as an attempt (see base.py, "Attempts"). One 1/0 each.
local out = {}
for i = 3, #ARGV, 2 do
  local jk = jkey(ARGV[i])
  if holds(jk, ARGV[i + 1]) then
    redis.call('HSET', jk, 'started', '1')
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out

-- == heartbeat ==
-- ARGV[3] id, [4] token, [5] visibility seconds. Returns {lease_until, cancel flag}, or
-- nil when the lease is gone. The pending entry's idle time is reset too (XCLAIM JUSTID
-- to the same consumer, no delivery counted): XPENDING then shows live leases as fresh.
local id, tok = ARGV[3], ARGV[4]
local jk = jkey(id)
if not holds(jk, tok) then return false end
local until_ = num(NOW + tonumber(ARGV[5]))
local h = hm(jk, 'device', 'priority', 'entry', 'worker', 'cancel', 'route')
local rt = h[6] or h[2]
check_device(h[1], {rt})
redis.call('HSET', jk, 'lease_until', until_)
redis.call('ZADD', leases_key(h[1]), until_, id)
if h[3] then redis.call('XCLAIM', qkey(h[1], rt), GROUP, h[4], 0, h[3], 'JUSTID') end
return {until_, h[5] or ''}

-- == progress ==
-- ARGV[3] id, [4] token, [5] the progress JSON. Stored in the job's hash (field
-- 'progress') only while the lease is current: 1, else 0.
local jk = jkey(ARGV[3])
if not holds(jk, ARGV[4]) then return 0 end
redis.call('HSET', jk, 'progress', ARGV[5])
return 1

-- == ack ==
-- ARGV[3] replay flags (one character per job), ARGV[4..]: groups of (id, token, result,
-- status). One 1/0 each.
check_jobs(4, 4)
local out = {}
for i = 4, #ARGV, 4 do
  local id, tok = ARGV[i], ARGV[i + 1]
  local jk = jkey(id)
  local replay = string.sub(ARGV[3], #out + 1, #out + 1)
  if holds(jk, tok) then
    local state = 'done'
    if ARGV[i + 3] == 'dead' then state = 'dead' end
    finish(id, state, ARGV[i + 2], nil, 'running', tok, 'acked')
    out[#out + 1] = 1
  elseif replayed(jk, tok, replay) == 'acked' then
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out

-- == retry ==
-- ARGV[3] replay, [4] id, [5] token, [6] delay seconds, [7] dead result, [8] dead letter
-- (used when this was the last allowed delivery). Returns scheduled, dead or lost.
local id, tok = ARGV[4], ARGV[5]
local jk = jkey(id)
if not holds(jk, tok) then return replayed(jk, tok, ARGV[3]) or 'lost' end
local h = hm(jk, 'attempt', 'max_attempts', 'device', 'priority', 'route')
local rt = h[5] or h[4]
check_device(h[3], {rt})
if tonumber(h[1]) >= tonumber(h[2]) then
  finish(id, 'dead', ARGV[7], ARGV[8], 'running', tok, 'dead')
  return 'dead'
end
unqueue(jk)
redis.call('ZREM', leases_key(h[3]), id)
redis.call('HSET', jk, 'state', 'queued', 'prev', tok .. ' scheduled')
redis.call('HDEL', jk, 'token', 'lease_until')
redis.call('HINCRBY', COUNTS, 'running', -1)
redis.call('HINCRBY', COUNTS, 'queued', 1)
local delay = tonumber(ARGV[6])
if delay > 0 then
  redis.call('ZADD', DELAYED, num(NOW + delay), id)
else
  enqueue(id, h[3], rt)
end
return 'scheduled'

-- == dead_letter ==
-- ARGV[3] replay, [4] id, [5] token, [6] result, [7] letter. Returns 1, or 0 when lost.
check_jobs(4, #ARGV)
local id, tok = ARGV[4], ARGV[5]
local jk = jkey(id)
if not holds(jk, tok) then
  if replayed(jk, tok, ARGV[3]) == 'dead' then return 1 end
  return 0
end
finish(id, 'dead', ARGV[6], ARGV[7], 'running', tok, 'dead')
return 1

-- == release ==
-- ARGV[3] replay, [4] id, [5] token. Back to the queue at once, this delivery not
-- counted. Returns 1, or 0 when lost.
local id, tok = ARGV[4], ARGV[5]
local jk = jkey(id)
if not holds(jk, tok) then
  if replayed(jk, tok, ARGV[3]) == 'released' then return 1 end
  return 0
end
local h = hm(jk, 'device', 'priority', 'route')
local rt = h[3] or h[2]
check_device(h[1], {rt})
unqueue(jk)
redis.call('ZREM', leases_key(h[1]), id)
redis.call('HINCRBY', jk, 'attempt', -1)
redis.call('HSET', jk, 'state', 'queued', 'prev', tok .. ' released')
redis.call('HDEL', jk, 'token', 'lease_until')
redis.call('HINCRBY', COUNTS, 'running', -1)
redis.call('HINCRBY', COUNTS, 'queued', 1)
enqueue(id, h[1], rt)
return 1

-- == cancel ==
-- ARGV[3] id. Returns cancelled (was queued: a cancelled result is stored), cancelling
-- (running: the flag reaches its worker), finished or unknown.
local id = ARGV[3]
local jk = jkey(id)
local h = hm(jk, 'state', 'device', 'attempt')
if not h[1] then return 'unknown' end
check_jobs(3, #ARGV)
if h[1] == 'queued' then
  redis.call('ZREM', DELAYED, id)
  local attempt = tonumber(h[3]) or 0
  -- As `base.queued_cancel_message` says it.
  local message = 'cancelled before it started'
  if attempt > 0 then
    message = 'cancelled while waiting to be retried, after ' .. attempt .. ' attempt(s)'
  end
  local result = cjson.encode({
    v = 1, job_id = id, status = 'cancelled', device = h[2], attempt = tonumber(h[3]),
    finished_at = NOW,
    error = {code = 'E_CANCELLED', message = message},
  })
  finish(id, 'done', result, nil, 'queued', nil, nil)
  return 'cancelled'
elseif h[1] == 'running' then
  redis.call('HSET', jk, 'cancel', '1')
  return 'cancelling'
end
return 'finished'

-- == await_result ==
-- ARGV[3] job id. Returns {result, known}: the stored result ('' for none yet; the job is
-- then marked as waited on, and `finish` writes done:<id> for it), known '0' for no job.
local jk = jkey(ARGV[3])
local h = hm(jk, 'state', 'result')
if h[2] then return {h[2], '1'} end
if not h[1] then return {'', '0'} end
redis.call('HSET', jk, 'waiter', '1')
return {'', '1'}

-- == cancel_requested ==
-- ARGV[3..] job ids. Returns those running with a cancel pending.
local out = {}
for i = 3, #ARGV do
  local h = hm(jkey(ARGV[i]), 'state', 'cancel')
  if h[1] == 'running' and h[2] == '1' then out[#out + 1] = ARGV[i] end
end
return out

-- == stats ==
-- ARGV[3] '1': the oldest too. Returns {queued, delayed, running, done, dead[, oldest]};
-- delayed counts queued jobs not yet due; oldest is the earliest `submitted_at` of a due
-- queued job ('' for none): among the first unread entry of each route's stream (the
-- oldest there: a stream is in enqueue order) and the delayed jobs already due but not
-- yet moved to theirs. A few commands per route, never a walk of the queue.
local c = redis.call('HMGET', COUNTS, 'queued', 'running', 'done', 'dead')
local delayed = redis.call('ZCOUNT', DELAYED, '(' .. num(NOW), '+inf')
local out = {c[1] or '0', tostring(delayed), c[2] or '0', c[3] or '0', c[4] or '0'}
if ARGV[3] ~= '1' then return out end
local oldest = nil
local function consider(id, eid)
  local h = hm(jkey(id), 'state', 'entry', 'body')
  if h[1] ~= 'queued' or (eid and h[2] ~= eid) then return false end
  local at = tonumber(string.match(h[3] or '', '"submitted_at"%s*:%s*([%d%.eE+-]+)'))
  if at and (not oldest or at < oldest) then oldest = at end
  return true
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', DELAYED, '-inf', num(NOW), 'LIMIT', 0, 16)) do
  consider(id, nil)
end
for _, dev in ipairs(redis.call('SMEMBERS', DEVICES)) do
  for _, rt in ipairs(redis.call('ZRANGE', prios_key(dev), 0, -1)) do
    local q = qkey(dev, rt)
    local last = nil
    local groups = redis.pcall('XINFO', 'GROUPS', q)
    for _, g in ipairs(groups) do
      local name, lid
      for j = 1, #g - 1, 2 do
        if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then lid = g[j + 1] end
      end
      if name == GROUP then last = lid end
    end
    if last then
      -- The first unread entry that is still its job's (a cancelled job's stays behind).
      for _, e in ipairs(redis.call('XRANGE', q, '(' .. last, '+', 'COUNT', 16)) do
        local f, id = e[2], nil
        for j = 1, #f - 1, 2 do if f[j] == 'id' then id = f[j + 1] end end
        if id and consider(id, e[1]) then break end
      end
    end
  end
end
out[6] = oldest and num(oldest) or ''
return out

-- == dead_letters ==
-- ARGV[3] limit. The most recent dead letters, newest first.
local out = {}
for _, id in ipairs(redis.call('ZREVRANGE', DEAD, 0, tonumber(ARGV[3]) - 1)) do
  local letter = hm(jkey(id), 'letter')[1]
  if letter then out[#out + 1] = letter end
end
return out

-- == purge ==
-- ARGV[3] age in seconds, [4] batch size. Forgets up to a batch of jobs that finished
-- more than that long ago, or whose result_ttl_s has passed: job, result, dead letter,
-- idempotency key, undo entries.
-- Returns {their ids, how many unconfirmed old undo entries went}.
local cut = num(NOW - tonumber(ARGV[3]))
local gone = redis.call('ZRANGEBYSCORE', FINISHED, '-inf', '(' .. cut, 'LIMIT', 0,
  tonumber(ARGV[4]))
-- And jobs whose result_ttl_s has passed, within the same batch size.
if #gone < tonumber(ARGV[4]) then
  local seen = {}
  for _, id in ipairs(gone) do seen[id] = true end
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', EXPIRING, '-inf', '(' .. num(NOW), 'LIMIT',
      0, tonumber(ARGV[4]) - #gone)) do
    if not seen[id] then gone[#gone + 1] = id end
  end
end
for _, id in ipairs(gone) do
  local jk = jkey(id)
  local h = hm(jk, 'state', 'ikey')
  if h[2] and h[2] ~= '' and redis.call('GET', idem_key(h[2])) == id then
    redis.call('DEL', idem_key(h[2]))
  end
  if h[1] == 'done' or h[1] == 'dead' then redis.call('HINCRBY', COUNTS, h[1], -1) end
  for _, e in ipairs(redis.call('SMEMBERS', job_undos_key(id))) do drop_undo(e) end
  redis.call('DEL', jk)
  redis.call('ZREM', FINISHED, id)
  redis.call('ZREM', EXPIRING, id)
  redis.call('ZREM', DEAD, id)
end
-- Undo entries recorded before the cut-off that no result lists (their worker died
-- between recording and acking; the commit journal rolled the change back).
local old = redis.call('ZRANGEBYSCORE', UNDO_AT, '-inf', '(' .. cut, 'LIMIT', 0,
  tonumber(ARGV[4]))
local dropped = 0
for _, e in ipairs(old) do
  local job_id = hm(undo_key(e), 'job_id')[1]
  local result = job_id and hm(jkey(job_id), 'result')[1]
  local listed = false
  if result then
    for _, u in ipairs(cjson.decode(result).undo_ids or {}) do
      if u == e then listed = true end
    end
  end
  if not listed then
    drop_undo(e)
    dropped = dropped + 1
  end
end
return {gone, dropped}

-- == record_undo ==
-- ARGV[3] job id, [4] token, [5] number of entries n, then n groups of (entry id, body,
-- space-separated blob digests), then the ids of the entries this (undo) job undid.
-- Fenced like an ack: nothing is written once the lease is gone. Returns 1 or 0.
local id, tok = ARGV[3], ARGV[4]
if not holds(jkey(id), tok) then return 0 end
local n = tonumber(ARGV[5])
for i = 6, 5 + 3 * n, 3 do
  local e = ARGV[i]
  local uk = undo_key(e)
  -- Recorded again (a redelivered job): the new body and blobs replace the old.
  count_blobs(redis.call('HGET', uk, 'blobs'), -1)
  redis.call('HSET', uk, 'body', ARGV[i + 1], 'job_id', id, 'at', num(NOW), 'blobs', ARGV[i + 2])
  count_blobs(ARGV[i + 2], 1)
  redis.call('ZADD', UNDO_AT, num(NOW), e)
  redis.call('SADD', job_undos_key(id), e)
end
for i = 6 + 3 * n, #ARGV do
  if redis.call('EXISTS', undo_key(ARGV[i])) == 1 then
    redis.call('HSET', undo_key(ARGV[i]), 'undone_by', id)
  end
end
return 1

-- == settle_gate ==
-- ARGV[3] job id, [4] its final result (JSON). An approval gate's answer: the stored result
-- is replaced only while it is the job's awaiting_approval one (the first answer wins; a
-- result is otherwise written once). Returns 1, or 0 (no such result, or already final).
local jk = jkey(ARGV[3])
local body = hm(jk, 'result')[1]
if not body or not string.match(body, '"status":"awaiting_approval"') then return 0 end
redis.call('HSET', jk, 'result', ARGV[4], 'done_at', num(NOW))
return 1

-- == get_undo ==
-- ARGV[3..] entry ids. Returns {id, body, undone_by or '', recorded at} for each known one.
local out = {}
for i = 3, #ARGV do
  local h = hm(undo_key(ARGV[i]), 'body', 'undone_by', 'at')
  if h[1] then out[#out + 1] = {ARGV[i], h[1], h[2] or '', h[3]} end
end
return out

-- == queued_routes ==
-- Jobs waiting in the streams (due, not yet leased), by device and route: a flat list of
-- (device, executor or '', count). Read-only (a device with no route left is forgotten
-- by the next lease that finds so; this only reads).
local out = {}
for _, dev in ipairs(redis.call('SMEMBERS', DEVICES)) do
  for _, rt in ipairs(redis.call('ZRANGE', prios_key(dev), 0, -1)) do
    local q = qkey(dev, rt)
    if redis.call('TYPE', q)['ok'] == 'stream' then
      local pending = 0
      for _, g in ipairs(redis.call('XINFO', 'GROUPS', q)) do
        for j = 1, #g - 1, 2 do
          if g[j] == 'pending' then pending = pending + g[j + 1] end
        end
      end
      out[#out + 1] = dev
      out[#out + 1] = route_exec(rt) or ''
      out[#out + 1] = tostring(redis.call('XLEN', q) - pending)
    end
  end
end
return out

-- == list_jobs ==
-- ARGV[3] the states wanted (space-separated), [4] an executor or '', [5] a device or '',
-- [6] the most to return. Jobs newest first by id (ids are time-ordered ULIDs unless a
-- producer chose its own), as a flat list of (id, executor, device, state, attempt,
-- worker or '', status or '', done_at or ''). Read-only.
local want = {}
for st in string.gmatch(ARGV[3], '%S+') do want[st] = true end
local exec_f, dev_f, limit = ARGV[4], ARGV[5], tonumber(ARGV[6])
local ids, seen = {}, {}
local function add(id)
  if not seen[id] then
    seen[id] = true
    ids[#ids + 1] = id
  end
end
local devices = redis.call('SMEMBERS', DEVICES)
devices[#devices + 1] = 'server'
if want['queued'] or want['running'] then
  for _, dev in ipairs(devices) do
    if dev_f == '' or dev == dev_f then
      if want['running'] then
        for _, id in ipairs(redis.call('ZRANGE', leases_key(dev), 0, -1)) do add(id) end
      end
      for _, rt in ipairs(redis.call('ZRANGE', prios_key(dev), 0, -1)) do
        local q = qkey(dev, rt)
        if redis.call('TYPE', q)['ok'] == 'stream' and (exec_f == '' or route_exec(rt) == exec_f) then
          for _, e in ipairs(redis.call('XREVRANGE', q, '+', '-', 'COUNT', limit)) do
            add(e[2][2])
          end
        end
      end
    end
  end
  if want['queued'] then
    for _, id in ipairs(redis.call('ZRANGE', DELAYED, 0, -1)) do add(id) end
  end
end
if want['done'] or want['dead'] then
  local from = FINISHED
  if not want['done'] then from = DEAD end
  for _, id in ipairs(redis.call('ZREVRANGE', from, 0, limit * 4)) do add(id) end
end
table.sort(ids, function(a, b) return a > b end)
local out, n = {}, 0
for _, id in ipairs(ids) do
  if n >= limit then break end
  local jk = jkey(id)
  local h = hm(jk, 'state', 'device', 'route', 'attempt', 'worker', 'done_at')
  local e = h[3] and route_exec(h[3])
  if h[1] and not e then  -- a job an older build queued: its executor is in its body
    e = string.match(hm(jk, 'body')[1] or '', '"executor":"([^"\\]*)"')
  end
  e = e or ''
  if h[1] and want[h[1]] and (exec_f == '' or e == exec_f) and (dev_f == '' or h[2] == dev_f) then
    local status = ''
    if h[6] then
      -- The result's own status: the first key of that name (msgspec writes it before
      -- the executor's output, and a quote inside a string is escaped).
      status = string.match(hm(jk, 'result')[1] or '', '"status":"([%a_]+)"') or ''
    end
    for _, v in ipairs({id, e, h[2] or '', h[1], h[4] or '0', h[5] or '', status, h[6] or ''}) do
      out[#out + 1] = v
    end
    n = n + 1
  end
end
return out

-- == set_aside ==
-- ARGV[3] a key the guard named, [4] its problem. A key of another type is renamed to
-- aside:<its name>:<now> (kept as evidence; the queue goes on with a fresh one); a counter
-- or priority that is not a number is copied there, then repaired in place (the counter
-- set to 0, the member removed). Returns the evidence's key, or '' when the key is fine
-- by now (fixed meanwhile).
local key, problem = ARGV[3], ARGV[4]
local kept = P .. '$aside' .. string.sub(key, #P + 1) .. ':' .. num(NOW)
local kind = string.match(problem, '^(%a+)=')
if kind == 'type' then
  local t = redis.call('TYPE', key)['ok']
  local want = string.match(problem, 'expected=(%a+)')
  if t == 'none' or t == want then return '' end
  redis.call('RENAME', key, kept)
  return kept
elseif kind == 'field' then
  local field = string.sub(problem, 7)
  local v = redis.call('HGET', key, field)
  if v == false or is_int(v) then return '' end
  redis.call('COPY', key, kept)
  redis.call('HSET', key, field, '0')
  return kept
elseif kind == 'member' then
  local member = string.sub(problem, 8)
  if redis.call('ZSCORE', key, member) == false or is_int(member) then return '' end
  redis.call('COPY', key, kept)
  redis.call('ZREM', key, member)
  return kept
end
return ''
