-- fleet's admission, run by HAProxy for every request to a target (fleet/gateway/haproxy.py loads it).
-- lua.fleet_admit(<backend>) answers:
--   "turn": the call (txn.call) is pinned to a host that lives (up, or draining): never refused, it goes there
--   "new":  a new call, and a host that takes new calls (up, not draining) has a free place
--   "full": a new call and no free place: overflow, or 503
-- A place is one concurrent stream of the host's measured capacity (its server's maxconn).

-- a server's status: "UP" (or "UP 1/2": a check failed, not yet down), "DRAIN", "NOLB", "MAINT", "DOWN"
-- (or "DOWN 1/2": coming back, not yet up)
local function takes_new(status)
  return status:sub(1, 2) == "UP"
end

local function alive(status)
  return takes_new(status) or status:sub(1, 5) == "DRAIN" or status:sub(1, 4) == "NOLB"
end

core.register_fetches("fleet_admit", function(txn, backend)
  local be = core.backends[backend]
  if be == nil then
    return "full"
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
  for _, srv in pairs(be.servers) do
    local stats = srv:get_stats()
    if takes_new(stats.status) then
      local limit = tonumber(stats.slim) or 0
      local current = tonumber(stats.scur) or 0
      if limit > current then
        return "new"
      end
    end
  end
  return "full"
end)
