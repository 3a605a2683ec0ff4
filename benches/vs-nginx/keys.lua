-- wrk script for idle pass-through: every request carries a client key
-- not seen recently, so nothing is ever shaped (each is a new idle client).
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", "/x", { ["X-Client"] = n .. "-" .. math.random(1, 1000000000) })
end
