-- wrk script for bench.request_timeline: POST /v1/classify with real queries, one per request,
-- cycled from the file named by the environment's WRK_BODIES (one JSON body per line); done()
-- prints one JSON line of percentiles (microseconds) and the error counts for the bench to parse.
local bodies, i = {}, 0
local path = os.getenv("WRK_BODIES")
for line in io.lines(path) do bodies[#bodies + 1] = line end
local route = os.getenv("WRK_PATH") or "/v1/classify"
local headers = {["Content-Type"] = "application/json"}

function init(args)
  -- threads start at different offsets so they do not send the same query at once
  i = math.random(#bodies) - 1
end

function request()
  i = i % #bodies + 1
  return wrk.format("POST", route, headers, bodies[i])
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, ' ..
    '"p999_us": %d, "max_us": %d, "mean_us": %.1f, "connect": %d, "read": %d, "write": %d, ' ..
    '"status": %d, "timeout": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.max, latency.mean,
    e.connect, e.read, e.write, e.status, e.timeout))
end
