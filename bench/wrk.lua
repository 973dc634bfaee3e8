-- wrk script of the benchmark harness.
-- Sends pre-built raw HTTP requests in turn: wrk ... -- PREFIX reads PREFIX.bin (the requests, back to back)
-- and PREFIX.idx (the length of each, one a line). At the end, prints one line "BENCH_JSON {...}" of results.

local requests = {}
local position = 0

function init(args)
  local blob = assert(io.open(args[1] .. ".bin", "rb")):read("*a")
  local offset = 1
  for line in assert(io.open(args[1] .. ".idx")):lines() do
    local length = tonumber(line)
    requests[#requests + 1] = blob:sub(offset, offset + length - 1)
    offset = offset + length
  end
end

function request()
  position = position % #requests + 1
  return requests[position]
end

function done(summary, latency, _)
  local errors = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"mean":%.1f,"max":%d,"p50":%d,"p90":%d,"p99":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    errors.connect, errors.read, errors.write, errors.status, errors.timeout,
    latency.mean, latency.max, latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
