-- wrk script: POST a payment to wrk's path, each request its own body and, when KEYED=1,
-- a new Idempotency-Key (the run, the thread and a counter make it unique).
-- Used by scripts/bench_overhead.sh.
local keyed = os.getenv("KEYED") == "1"
local token = os.getenv("TOKEN") or "tok_bench"
local run = os.getenv("RUN") or tostring(os.time())
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end

local n = 0
function request()
  n = n + 1
  local body = string.format(
    '{"amount":%d,"currency":"EUR","customer":"wrk-%d","description":"load test"}',
    100 + n % 9000, n % 1000)
  local headers = {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json",
  }
  if keyed then
    headers["Idempotency-Key"] = string.format("wrk-%s-%d-%d", run, id, n)
  end
  return wrk.format("POST", nil, headers, body)
end
