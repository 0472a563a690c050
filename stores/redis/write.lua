-- One guarded write of a session (agent_sessions.backend: Guard, Change), atomic as every script is.
-- KEYS: row, messages, steers, queue, keys, events, the updated index, the open index.
-- ARGV: session, guard JSON, change JSON, the metadata index keys of the change's metadata (JSON), a new
-- incarnation. Metadata values are indexed by their JSON form as Python writes it, so those keys come
-- from the caller (the row keeps them as "mkeys"), never from Lua's JSON.
-- Returns {done, row, journal, now, steers waiting, queue items waiting}: row is the row's hash after (done) or
-- as it stands, as one JSON object (one reply to parse, not a pair of replies per field) but its journal, which
-- may be long and is JSON already (escaped again it would grow by a byte per quote): a reply of its own, or nil;
-- {done} alone when there is no row.
local rowkey, msgs, steers, queue, keys, events, updated_idx, open_idx =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local session, guard, change = ARGV[1], cjson.decode(ARGV[2]), cjson.decode(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000

local function load()
  local flat = redis.call('HGETALL', rowkey)
  local row = {}
  for i = 1, #flat, 2 do row[flat[i]] = flat[i + 1] end
  return row, #flat > 0
end
local row, present = load()
local function num(name) return tonumber(row[name] or '0') end
local function answer(done)
  local after, present = load()
  if not present then return {done} end
  local journal = after.journal
  after.journal = nil
  return {done, cjson.encode(after), journal or false, string.format('%.6f', now), redis.call('LLEN', steers),
          redis.call('LLEN', queue)}
end
local function steer_ids()
  local ids = {}
  for _, item in ipairs(redis.call('LRANGE', steers, 0, -1)) do ids[cjson.decode(item)[1]] = item end
  return ids
end

-- the guard
local held = row.token ~= nil
local ok = true
if guard.exists ~= nil then ok = ok and ((row.exists == '1') == guard.exists) end
if guard.incarnation ~= nil then ok = ok and (row.inc or '') == guard.incarnation end
if guard.version ~= nil then ok = ok and num('version') == guard.version end
if guard.length ~= nil then ok = ok and num('length') == guard.length end
if guard.edits ~= nil then ok = ok and num('edits') == guard.edits end
if guard.lease ~= nil then ok = ok and row.token == guard.lease[1] and num('epoch') == guard.lease[2] end
if guard.lease_free then ok = ok and not (held and num('expires') > now) end
if guard.lease_held then ok = ok and held end
if guard.not_cancelled then ok = ok and row.cancelled ~= '1' end
if guard.no_steers then ok = ok and redis.call('LLEN', steers) == 0 end
if guard.steers ~= nil and ok then
  local ids = steer_ids()
  for _, id in ipairs(guard.steers) do ok = ok and ids[id] ~= nil end
end
if guard.journal ~= nil then
  local want = guard.journal[1]
  if want == cjson.null then ok = ok and row.journal == nil else ok = ok and row.journal == want end
end
if guard.no_queue then ok = ok and redis.call('LLEN', queue) == 0 end
if guard.queue_head ~= nil and ok then
  local head = redis.call('LINDEX', queue, 0)
  ok = head and cjson.decode(head)[1] == guard.queue_head
end
if guard.key_absent ~= nil then ok = ok and redis.call('SISMEMBER', keys, guard.key_absent) == 0 end
if not ok then return answer(0) end
if next(change) == nil then return answer(1) end

local function meta_keys(text)
  if text == nil then return {} end
  return cjson.decode(text)
end

if change.delete then
  local before = answer(1)
  for _, key in ipairs(meta_keys(row.mkeys)) do redis.call('ZREM', key, session) end
  redis.call('DEL', rowkey, msgs, steers, queue, keys, events)
  redis.call('ZREM', updated_idx, session)
  redis.call('ZREM', open_idx, session)
  return before
end

local version = num('version') + 1
local set = {'version', version}
local function put(name, value) set[#set + 1] = name; set[#set + 1] = value end
local exists = row.exists == '1'
if change.exist then
  if not exists then
    put('exists', '1'); put('inc', ARGV[5]); put('created', string.format('%.6f', now))
  end
  local updated = math.max(num('updated'), now)
  put('updated', string.format('%.6f', updated))
  redis.call('ZADD', updated_idx, updated, session)
  local mkeys = row.mkeys
  if change.metadata ~= nil then mkeys = ARGV[4] end
  for _, key in ipairs(meta_keys(mkeys)) do redis.call('ZADD', key, updated, session) end
  exists = true
end
if change.splice ~= nil then
  local at, texts = change.splice[1], change.splice[2]
  if at == 0 then redis.call('DEL', msgs) else redis.call('LTRIM', msgs, 0, at - 1) end
  for i = 1, #texts, 1000 do redis.call('RPUSH', msgs, unpack(texts, i, math.min(i + 999, #texts))) end
  put('edits', num('edits') + 1); put('length', at + #texts)
end
if change.take_steers ~= nil then
  local ids = steer_ids()
  for _, id in ipairs(change.take_steers) do
    if ids[id] then redis.call('LREM', steers, 1, ids[id]) end
  end
end
if change.add_steer ~= nil then
  redis.call('RPUSH', steers, cjson.encode({version, change.add_steer[1], change.add_steer[2]}))
end
if change.push ~= nil then
  redis.call('RPUSH', queue, cjson.encode({version, change.push[1], change.push[2]}))
end
if change.pop ~= nil then
  for _, item in ipairs(redis.call('LRANGE', queue, 0, -1)) do
    if cjson.decode(item)[1] == change.pop then redis.call('LREM', queue, 1, item); break end
  end
end
if change.add_key ~= nil then redis.call('SADD', keys, change.add_key) end
if change.drop_key ~= nil then redis.call('SREM', keys, change.drop_key) end
local unset = {}
if change.journal ~= nil then
  local text = change.journal[1]
  if text == cjson.null then unset[#unset + 1] = 'journal' else put('journal', text) end
end
if change.turn ~= nil then
  local key = change.turn[1]
  if key == cjson.null then unset[#unset + 1] = 'turn' else put('turn', key) end
end
if change.handed ~= nil then put('handed', change.handed and '1' or '0') end
local lease = change.lease
if lease ~= nil then
  if lease.acquire then
    local a = lease.acquire
    put('token', a.token); put('epoch', num('epoch') + 1); put('expires', string.format('%.6f', now + a.ttl))
    put('host', a.host); put('pid', a.pid)
    if a.spec == cjson.null then unset[#unset + 1] = 'spec' else put('spec', a.spec) end
    if a.turn == cjson.null then unset[#unset + 1] = 'turn' else put('turn', a.turn) end
    put('handed', (row.handed == '1' or row.cancelled == '1') and '1' or '0'); put('cancelled', '0')
  elseif lease.renew then
    put('expires', string.format('%.6f', now + lease.renew))
  elseif lease.release then
    unset[#unset + 1] = 'token'
    put('handed', (row.handed == '1' or row.cancelled == '1') and '1' or '0')
    put('cancelled', '0')
  elseif lease.cancel then
    put('cancelled', '1')
    if row.turn == nil then unset[#unset + 1] = 'cturn' else put('cturn', row.turn) end
  end
end
local open = row.open
if change.open == 'set' then
  if open == nil then open = string.format('%.6f', now); put('open', open) end
elseif change.open == 'clear' then
  open = nil
  unset[#unset + 1] = 'open'
end
if exists and open ~= nil then redis.call('ZADD', open_idx, tonumber(open), session)
else redis.call('ZREM', open_idx, session) end
if change.metadata ~= nil then
  local new = {}
  for _, key in ipairs(meta_keys(ARGV[4])) do new[key] = true end
  for _, key in ipairs(meta_keys(row.mkeys)) do
    if not new[key] then redis.call('ZREM', key, session) end
  end
  put('meta', change.metadata); put('mkeys', ARGV[4])
end
if change.events ~= nil then
  local seq = num('last_seq')
  if seq == 0 then seq = math.floor(now * 1000000) - 1 end
  for _, text in ipairs(change.events) do
    seq = seq + 1
    redis.call('ZADD', events, seq, string.format('%.0f', seq) .. ':' .. text)
  end
  redis.call('ZREMRANGEBYRANK', events, 0, -(change.keep + 1))
  put('last_seq', string.format('%.0f', seq))
end
redis.call('HSET', rowkey, unpack(set))
if #unset > 0 then redis.call('HDEL', rowkey, unpack(unset)) end
return answer(1)
