-- What the agents feel through the gateway, per target backend and host slot (fleet/gateway/haproxy.py puts
-- this filter on each calls_tN backend; fleet reads it with `fleet metrics` on the admin socket):
--   first content: from the request entering the backend (admitted, its body read) to the first byte of a
--     non-empty "content" string in the answer (a streamed delta, or the whole reply when not streamed), as
--     counts in the buckets of BUCKETS_MS (the last one: every slower answer)
--   warm turns: the turns of a call in progress (admission said "turn") answered 200, those whose host took
--     part of the prompt from its cache (its `timings`: cache_n > 0), and the prompt tokens it took from its
--     cache and those it processed
-- What a host sends is read, never trusted: the reply's last 2 KiB (of its last two pieces) are searched for its
-- timings, and a count of more than 9 digits is not a count.

local BUCKETS_MS = { 10, 25, 50, 100, 150, 200, 300, 500, 750, 1000, 2000, 5000, 10000 }
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local agent_keys = Map.new(here .. "agent-keys.map", Map._str)  -- a key's SHA-256 -> its agent, while live
local TAIL_BYTES = 2048

-- "backend server" -> { buckets = {...}, count, sum_ms, warm, warm_cached, cached_tokens, processed_tokens }
local seen = {}

local function now_ms()
  local t = core.now()
  return t.sec * 1000 + t.usec / 1000
end

local function entry(backend, server)
  local key = backend .. " " .. server
  local e = seen[key]
  if e == nil then
    e = {
      buckets = {}, count = 0, sum_ms = 0, warm = 0, warm_cached = 0, cached_tokens = 0, processed_tokens = 0,
      answered = 0,
    }
    for i = 1, #BUCKETS_MS + 1 do
      e.buckets[i] = 0
    end
    seen[key] = e
  end
  return e
end

-- a count made 0, padded with spaces to its length (JSON allows them after a value): a reply whose length is
-- declared keeps it
local function hide(name, digits)
  return name .. "0" .. string.rep(" ", #digits - 1)
end

-- what a host (or the overflow's API) took from its cache is fleet's to read, not the agent's: a cache may hold
-- another call's prompt, and a count of the tokens that matched it would tell how much of a guessed transcript
-- is right (fleet's hosts keep each agent's cache apart as well: the gateway salts its requests)
local CACHE_COUNTS = { "cache_n", "cached_tokens" }
-- the overflow's cache is not salted: the prompt tokens it processed (the prompt's less the cached) go too
local OVERFLOW_COUNTS = { "cache_n", "cached_tokens", "prompt_n" }

local function blind(msg, body, names)
  local hidden = body
  for _, name in ipairs(names) do
    hidden = hidden:gsub('("' .. name .. '"%s*:%s*)(%d+)', hide)
  end
  if hidden ~= body then
    msg:set(hidden)
  end
end

local function count_of(text, name)
  local digits = text:match('"' .. name .. '":(%d+)')
  if digits == nil or #digits > 9 then
    return nil
  end
  return tonumber(digits)
end

local Observe = {}
Observe.id = "fleet observe"
Observe.flags = filter.FLT_CFG_FL_HTX
Observe.__index = Observe

function Observe:new()
  return setmetatable({ t0 = nil, first_ms = nil, before = nil, last = nil, status = nil }, Observe)
end

function Observe:start_analyze(txn, chn)
  if not chn:is_resp() then
    self.t0 = now_ms()
  end
end

-- a key revoked since its stream began (out of this gateway's map, or marked revoked by any gateway: peers
-- share the table): its streams end at their next piece, and the host stops working for it
local function revoked(key)
  if agent_keys:lookup(key) == nil then
    return true
  end
  local table = core.backends["revoked_keys"]
  local entry = table ~= nil and table.stktable ~= nil and table.stktable:lookup(key) or nil
  return entry ~= nil and (tonumber(entry.gpc0) or 0) > 0
end

function Observe:http_headers(txn, msg)
  if msg.channel:is_resp() then
    self.key = txn:get_var("txn.agent_key")
    local line = msg:get_stline()
    self.status = line and tonumber(line.code)
    filter.register_data_filter(self, msg.channel)
  end
end

function Observe:http_payload(txn, msg)
  if self.key ~= nil and revoked(self.key) then
    error("the key of this stream was revoked")
    return
  end
  local body = msg:body()
  if body == nil or #body == 0 then
    return
  end
  if self.first_ms == nil and self.t0 ~= nil and body:find('"content":"[^"]') then
    self.first_ms = now_ms() - self.t0
  end
  -- the last two pieces, kept as they came (a stream's timings ride its last event, before [DONE]): joined
  -- once at the end, never per piece, which would cost every token a copy
  self.before, self.last = self.last, body
  if body:find("cache", 1, true) then
    blind(msg, body, CACHE_COUNTS)
  end
end

function Observe:http_end(txn, msg)
  if not msg.channel:is_resp() then
    return
  end
  local e = entry(txn.f:be_name() or "-", txn.f:srv_name() or "-")
  e.answered = e.answered + 1 -- requests this host answered since it took the slot, whatever their status
  if self.status ~= 200 then
    return
  end
  if self.first_ms ~= nil then
    local i = 1
    while i <= #BUCKETS_MS and self.first_ms > BUCKETS_MS[i] do
      i = i + 1
    end
    e.buckets[i] = e.buckets[i] + 1
    e.count = e.count + 1
    e.sum_ms = e.sum_ms + self.first_ms
    txn:set_var("txn.first_content_ms", math.floor(self.first_ms))  -- the access log's
  end
  local tail = (self.before or "") .. (self.last or "")
  tail = tail:sub(-TAIL_BYTES)
  local cached, processed = count_of(tail, "cache_n"), count_of(tail, "prompt_n")
  if cached ~= nil and processed ~= nil then  -- the access log's (the agent sees cache_n as 0)
    txn:set_var("txn.cached_tokens", cached)
    txn:set_var("txn.processed_tokens", processed)
  end
  if txn:get_var("txn.admit") == "turn" then
    e.warm = e.warm + 1
    if cached ~= nil and cached > 0 then
      e.warm_cached = e.warm_cached + 1
    end
    e.cached_tokens = e.cached_tokens + (cached or 0)
    e.processed_tokens = e.processed_tokens + (processed or 0)
  end
end

core.register_filter("fleet_observe", Observe, function(f)
  return f
end)

-- the overflow's answers, blinded alike (a hosted API's cache serves every agent of this fleet's account)
local Blind = {}
Blind.id = "fleet blind"
Blind.flags = filter.FLT_CFG_FL_HTX
Blind.__index = Blind

function Blind:new()
  return setmetatable({}, Blind)
end

function Blind:http_headers(txn, msg)
  if msg.channel:is_resp() then
    filter.register_data_filter(self, msg.channel)
  end
end

function Blind:http_payload(txn, msg)
  local body = msg:body()
  if body ~= nil and #body > 0 then
    blind(msg, body, OVERFLOW_COUNTS)
  end
end

core.register_filter("fleet_blind", Blind, function(f)
  return f
end)

-- `fleet metrics`: a line of the buckets' upper bounds (ms), then one line a backend and slot:
--   BACKEND SERVER COUNT SUM_MS BUCKET_1 ... BUCKET_N+1 WARM WARM_CACHED CACHED_TOKENS PROCESSED_TOKENS ANSWERED
core.register_cli({ "fleet", "metrics" }, "fleet: first content and warm turns per host slot", function(applet)
  local lines = { "le " .. table.concat(BUCKETS_MS, " ") }
  for key, e in pairs(seen) do
    lines[#lines + 1] = string.format(
      "%s %d %.3f %s %d %d %d %d %d",
      key,
      e.count,
      e.sum_ms,
      table.concat(e.buckets, " "),
      e.warm,
      e.warm_cached,
      e.cached_tokens,
      e.processed_tokens,
      e.answered
    )
  end
  applet:send(table.concat(lines, "\n") .. "\n")
end)

-- `fleet forget BACKEND SERVER`: a new host took the slot; its counts start again.
core.register_cli({ "fleet", "forget" }, "fleet: forget a host slot's counts", function(applet, _, _, backend, server)
  if backend ~= nil and server ~= nil then
    seen[backend .. " " .. server] = nil
  end
  applet:send("\n")
end)
