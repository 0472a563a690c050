-- One read of a session (agent_sessions.backend: Want), from one moment.
-- KEYS: row, messages, steers, queue. ARGV: want JSON.
-- Returns {} when there is no row, else {row (its hash as one JSON object but the journal), the journal (or
-- nil), now, steers waiting, queue items waiting, the first message's index, messages, steers, queue items}.
local rowkey, msgs, steers, queue = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local want = cjson.decode(ARGV[1])
local flat = redis.call('HGETALL', rowkey)
if #flat == 0 then return {} end
local row = {}
for i = 1, #flat, 2 do row[flat[i]] = flat[i + 1] end
local journal = row.journal
row.journal = nil
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local start, texts = 0, {}
if want.start ~= nil or want.last ~= nil then
  local length = redis.call('LLEN', msgs)
  local stop = length
  if want.stop ~= nil and want.stop < length then stop = want.stop end
  if want.start ~= nil then start = want.start else start = math.max(stop - want.last, 0) end
  if stop > start then texts = redis.call('LRANGE', msgs, start, stop - 1) end
end
local waiting, queued = {}, {}
if want.steers then waiting = redis.call('LRANGE', steers, 0, -1) end
if want.queue then queued = redis.call('LRANGE', queue, 0, -1) end
return {cjson.encode(row), journal or false, string.format('%.6f', now), redis.call('LLEN', steers), redis.call('LLEN', queue), start, texts,
        waiting, queued}
