-- What HAProxy checks on a request before Triton sees it (loaded by proxy/haproxy.cfg).
--
-- token: with PROXY_TOKEN_FILE set, every request carries "authorization: Bearer <the file's first line>"
--   (HTTP header or gRPC metadata), else 401.
-- shape-within-body: an HTTP inference request's JSON (the whole body, or the part before the binary data
--   that Inference-Header-Content-Length names) is parsed as Triton will parse it, and no input may declare
--   more elements than the body has bytes. Triton 2.51 sizes buffers from the declared shape before it looks
--   at the data: a ~100-byte request declaring [100000,3,224,224] aborts it (std::bad_alloc). Every real
--   request carries at least one byte per element (JSON data: 2 or more; binary: the element's size), so the
--   rule refuses only requests the server could never have been sent honestly.
-- Refusals are JSON {"error": "proxy rule <name>: <why>"}, the shape Triton's own errors have, so that
-- tritonclient shows the reason.

local MAX_DEPTH = 64

-- A strict JSON parser (RFC 8259: no comments, NaN, trailing commas or duplicate keys), so that what is checked
-- here is what Triton's parser reads: an object with a key twice, or any JSON it would read another way, is
-- refused rather than guessed at.
local parse_value

local function fail(message, at)
  error({json = string.format("%s at byte %d", message, at)}, 0)
end

local function skip(s, i)
  return s:find("[^ \t\r\n]", i) or #s + 1
end

local function utf8_of(code)
  if code < 0x80 then return string.char(code) end
  if code < 0x800 then return string.char(0xC0 | (code >> 6), 0x80 | (code & 0x3F)) end
  if code < 0x10000 then
    return string.char(0xE0 | (code >> 12), 0x80 | ((code >> 6) & 0x3F), 0x80 | (code & 0x3F))
  end
  return string.char(0xF0 | (code >> 18), 0x80 | ((code >> 12) & 0x3F), 0x80 | ((code >> 6) & 0x3F),
                     0x80 | (code & 0x3F))
end

local ESCAPES = {['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t"}

local function parse_string(s, i)  -- s:sub(i, i) is the opening quote
  local out, j = {}, i + 1
  while true do
    local stop = s:find('["\\%c]', j)
    if not stop then fail("unterminated string", i) end
    out[#out + 1] = s:sub(j, stop - 1)
    local c = s:sub(stop, stop)
    if c == '"' then return table.concat(out), stop + 1 end
    if c ~= "\\" then fail("control character in a string", stop) end
    local e = s:sub(stop + 1, stop + 1)
    if ESCAPES[e] then
      out[#out + 1], j = ESCAPES[e], stop + 2
    elseif e == "u" then
      local hex = s:match("^%x%x%x%x", stop + 2)
      if not hex then fail("bad \\u escape", stop) end
      local code = tonumber(hex, 16)
      j = stop + 6
      if code >= 0xD800 and code <= 0xDBFF then
        local low = s:match("^\\u(%x%x%x%x)", j)
        low = low and tonumber(low, 16)
        if not low or low < 0xDC00 or low > 0xDFFF then fail("lone surrogate", stop) end
        code, j = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00), j + 6
      elseif code >= 0xDC00 and code <= 0xDFFF then
        fail("lone surrogate", stop)
      end
      out[#out + 1] = utf8_of(code)
    else
      fail("bad escape", stop)
    end
  end
end

-- Numbers keep whether they were written as integers: Triton reads a shape's dims as int64 and refuses 2.0 or 1e3.
local NUMBER = {}

local function digits(s, j)  -- past a run of one or more digits at j
  if not s:match("^%d", j) then fail("bad number", j) end
  return s:find("[^%d]", j) or #s + 1
end

local function parse_number(s, i)
  local j, integer = i, true
  if s:sub(j, j) == "-" then j = j + 1 end
  if s:sub(j, j) == "0" then j = j + 1 else j = digits(s, j) end
  if s:sub(j, j) == "." then j, integer = digits(s, j + 1), false end
  if s:match("^[eE]", j) then
    j = j + 1
    if s:match("^[-+]", j) then j = j + 1 end
    j, integer = digits(s, j), false
  end
  return setmetatable({value = tonumber(s:sub(i, j - 1)), integer = integer}, NUMBER), j
end

local function parse_container(s, i, depth, closing)
  if depth > MAX_DEPTH then fail("nested deeper than " .. MAX_DEPTH, i) end
  local result, keys, n = {}, {}, 0
  i = skip(s, i + 1)
  if s:sub(i, i) == closing then return result, i + 1 end
  while true do
    local key
    if closing == "}" then
      if s:sub(i, i) ~= '"' then fail("expected a key", i) end
      key, i = parse_string(s, i)
      if keys[key] then fail("duplicate key '" .. key .. "'", i) end
      keys[key] = true
      i = skip(s, i)
      if s:sub(i, i) ~= ":" then fail("expected ':'", i) end
      i = skip(s, i + 1)
    else
      n = n + 1
      key = n
    end
    result[key], i = parse_value(s, i, depth + 1)
    i = skip(s, i)
    local c = s:sub(i, i)
    if c == closing then return result, i + 1 end
    if c ~= "," then fail("expected ',' or '" .. closing .. "'", i) end
    i = skip(s, i + 1)
  end
end

local LITERALS = {["true"] = true, ["false"] = false, null = "null"}

parse_value = function(s, i, depth)
  local c = s:sub(i, i)
  if c == "{" then return parse_container(s, i, depth, "}") end
  if c == "[" then return parse_container(s, i, depth, "]") end
  if c == '"' then return parse_string(s, i) end
  if c == "-" or c:match("^%d$") then return parse_number(s, i) end
  for word, value in pairs(LITERALS) do
    if s:sub(i, i + #word - 1) == word then return value, i + #word end
  end
  fail("unexpected character", i)
end

local function parse_json(s)
  local value, i = parse_value(s, skip(s, 1), 1)
  if skip(s, i) <= #s then fail("text after the JSON value", i) end
  return value
end

local function is_list(t)
  return type(t) == "table" and getmetatable(t) == nil and #t == select(2, pcall(function()
    local n = 0
    for _ in pairs(t) do n = n + 1 end
    return n
  end))
end

-- The inference request's inputs: an error message where one declares more elements than `limit`.
local function shape_problem(request, limit)
  if type(request) ~= "table" or getmetatable(request) ~= nil then return "the request is not a JSON object" end
  local inputs = request.inputs
  if inputs == nil then return nil end
  if not is_list(inputs) then return "'inputs' is not a list" end
  for _, input in ipairs(inputs) do
    local shape = type(input) == "table" and input.shape
    if not is_list(shape) then return "an input has no 'shape' list" end
    local elements = 1.0
    for _, dim in ipairs(shape) do
      if getmetatable(dim) ~= NUMBER or not dim.integer or dim.value < 0 then
        return "a shape holds something other than a non-negative integer"
      end
      elements = elements * dim.value
    end
    if elements > limit then
      local name = type(input.name) == "string" and input.name:sub(1, 64) or "?"
      return string.format("input %s declares %.0f elements in a %d-byte body", name, elements, limit)
    end
  end
  return nil
end

local function read_token()
  local path = os.getenv("PROXY_TOKEN_FILE")
  if not path or path == "" then return nil end
  local file = assert(io.open(path, "r"), "PROXY_TOKEN_FILE " .. path .. " cannot be read")
  local token = (file:read("l") or ""):gsub("%s+$", "")
  file:close()
  assert(#token >= 16, "PROXY_TOKEN_FILE holds a token shorter than 16 characters")
  return "Bearer " .. token
end

local EXPECTED = read_token()  -- read once, at load: a request never touches the file

local function header(txn, name)
  local values = txn.http:req_get_headers()[name]
  return values and values[0]
end

local GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
-- HTTP statuses as gRPC status codes (UNAUTHENTICATED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT, FAILED_PRECONDITION).
local GRPC_STATUS = {[401] = "16", [413] = "8", [400] = "3", [411] = "9"}

local function refuse(txn, status, rule, why)
  why = string.format("proxy rule %s: %s", rule, (why:gsub('[%c\\"%%]', "'")))
  if (header(txn, "content-type") or ""):find("^application/grpc") then
    -- A gRPC client reads its error from grpc-status / grpc-message (a "trailers-only" answer), not a body.
    txn:done(txn:reply({status = 200, headers = {["content-type"] = {"application/grpc"},
      ["grpc-status"] = {GRPC_STATUS[status] or "2"}, ["grpc-message"] = {why}}}))
  else
    local body = string.format('{"error":"%s"}', why)
    txn:done(txn:reply({status = status, headers = {["content-type"] = {"application/json"}}, body = body}))
  end
end

local MAX_BODY = tonumber(os.getenv("PROXY_MAX_BODY") or "")

-- A unary gRPC inference request is one message: 1 byte (compressed?) and its length, 4 bytes big-endian, then
-- the message. HTTP/2 has no Content-Length to cap, the message says its own length.
local function grpc_problem(txn)
  local head = txn:get_var("txn.inspect") or ""
  if #head < 5 then return 400, "grpc-message", "the request does not start with a gRPC message header" end
  local length = string.unpack(">I4", head, 2)
  if MAX_BODY and length > MAX_BODY then
    return 413, "body-limit", string.format("a gRPC message of %d bytes, over %d", length, MAX_BODY)
  end
end

-- Nothing where the request may pass, else (HTTP status, rule, why).
local function check(txn)
  if EXPECTED and header(txn, "authorization") ~= EXPECTED then
    return 401, "token", "missing or wrong 'authorization: Bearer' token"
  end
  if txn.f:path() == GRPC_INFER then return grpc_problem(txn) end
  if txn.f:method() ~= "POST" or not txn.f:path():match("/infer$") then return end  -- gRPC: .../ModelInfer
  local length = tonumber(header(txn, "content-length") or "")
  if not length then
    return 411, "content-length", "an inference request must say its Content-Length"
  end
  -- The body's first bytes (haproxy.cfg sets txn.inspect): the JSON part of a binary request is a few hundred
  -- bytes at its start, and copying a whole 600 KB tensor into Lua for it would cost every request.
  local body = txn:get_var("txn.inspect") or ""
  local json_length = length
  local binary = header(txn, "inference-header-content-length")
  if binary then
    json_length = tonumber(binary)
    if not json_length or json_length < 0 or json_length ~= math.floor(json_length) or json_length > length then
      return 400, "json-header", "Inference-Header-Content-Length is not a length within the body"
    end
  end
  if json_length > #body then
    return 413, "json-header", string.format("the JSON part (%d bytes) exceeds what the proxy inspects (%d): "
                                             .. "send tensors as binary data (tritonclient does by default)",
                                             json_length, #body)
  end
  local ok, request = pcall(parse_json, body:sub(1, json_length))
  if not ok then
    return 400, "json", type(request) == "table" and request.json or tostring(request)
  end
  local problem = shape_problem(request, length)
  if problem then return 400, "shape-within-body", problem end
end

core.register_action("guard", {"http-req"}, function(txn)
  local ok, status, rule, why = pcall(check, txn)
  if not ok then  -- fail closed: a request the guard could not judge does not reach Triton
    status, rule, why = 400, "guard", "the proxy could not check this request: " .. tostring(status):sub(1, 200)
  end
  if status then refuse(txn, status, rule, why) end
end, 0)
