-- fleet's admission, run by HAProxy for every request to a target (fleet/gateway/haproxy.py loads it).
-- lua.fleet_admit(<backend>) answers:
--   "turn": the call (txn.call) is pinned to a host that lives (up, or draining): never refused, it goes there
--   "new":  a new call, and a host that takes new calls (up, not draining) has a free place
--   "full": a new call and no free place: overflow, or 503
--   "none": a new call, and no host takes new calls at all (none READY): overflow, or 503 saying so
-- A place is one call of the calls its host holds in conversation (host-calls.map beside this file, which fleet
-- keeps: `fleet bench`'s capacity in calls), counted as the calls whose turns reached its slot's door within the
-- call idle time (the door section's stick table: one entry a call, forgotten that long after its last turn;
-- its size is read, never its entries, so a new call costs the same at 10 calls or 200,000); a host never
-- benched for calls has one place per concurrent stream of its measured capacity (its server's maxconn). Turns
-- in flight beyond the maxconn wait in HAProxy's queue.

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local calls_limit = Map.new(here .. "host-calls.map", Map._str)

-- a server's status: "UP" (or "UP 1/2": a check failed, not yet down), "DRAIN", "NOLB", "MAINT", "DOWN"
-- (or "DOWN 1/2": coming back, not yet up)
local function takes_new(status)
  return status:sub(1, 2) == "UP"
end

local function alive(status)
  return takes_new(status) or status:sub(1, 5) == "DRAIN" or status:sub(1, 4) == "NOLB"
end

-- the calls in conversation on a backend's server: its slot's door section (calls_tN/sS -> host_tN_S) counts them
local function in_conversation(backend, server)
  local door = core.backends["host_" .. backend:sub(7) .. "_" .. server:sub(2)]
  if door == nil or door.stktable == nil then
    return 0
  end
  return tonumber(door.stktable:info().used) or 0
end

-- the headers a host (or the overflow) is sent of an agent's request: its framing and its body's type. An
-- agent's cookies, user agent, call id and own headers stay here: the host learns nothing of it but its prompt
-- (fleet's own headers, the host's key and the cache salt, are set after this)
local FORWARDED = {
  ["content-length"] = true, ["content-type"] = true, ["accept"] = true, ["host"] = true,
  ["transfer-encoding"] = true,
}

core.register_action("fleet_forward_only_needed", { "http-req" }, function(txn)
  for name in pairs(txn.http:req_get_headers()) do
    if not FORWARDED[string.lower(name)] then
      txn.http:req_del_header(name)
    end
  end
end)

core.register_fetches("fleet_admit", function(txn, backend)
  local be = core.backends[backend]
  if be == nil then
    return "none"
  end
  local call = txn:get_var("txn.call")
  if call ~= nil and be.stktable ~= nil then
    -- the entry names its server (server_key, HAProxy 2.6's Lua has no Server:get_puid to match server_id by)
    local entry = be.stktable:lookup(call)
    local srv = entry ~= nil and entry.server_key ~= nil and be.servers[entry.server_key] or nil
    if srv ~= nil and alive(srv:get_stats().status) then
      return "turn"
    end
  end
  local open = false
  for name, srv in pairs(be.servers) do
    local stats = srv:get_stats()
    if takes_new(stats.status) then
      open = true
      local limit = tonumber(calls_limit:lookup(backend .. "/" .. name))
      if limit ~= nil then
        if in_conversation(backend, name) < limit then
          return "new"
        end
      elseif (tonumber(stats.slim) or 0) > (tonumber(stats.scur) or 0) then
        return "new"
      end
    end
  end
  if not open then
    return "none"
  end
  return "full"
end)
