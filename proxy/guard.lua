-- What HAProxy checks on a request before Triton sees it (loaded by proxy/haproxy.cfg, one copy per thread).
--
-- token: with PROXY_TOKEN_FILE set, every request carries "authorization: Bearer <the file's first line>"
--   (HTTP header or gRPC metadata), else 401; but GET /v2/health/ready, /v2/health/live and /metrics (probes and
--   scrapes, which send no secret).
-- An inference request is admitted only as the served model declares it (rule "model", "inputs", "shape",
--   "datatype", "data-size"): the proxy reads the model's configuration from Triton itself (its private port,
--   /v2/models/NAME[/versions/V]/config, cached for CONFIG_TTL_MS and read again when a request fails against
--   an older copy), and every input of the request must be one the model declares, with its datatype, each dim
--   a non-negative integer equal to the model's (any where the model says -1; at most max_batch_size for the
--   batch dim), every required input present, and the data the request carries exactly what that shape needs
--   (JSON: as many values; binary and gRPC raw contents: elements x element size; BYTES: 4 bytes or more per
--   element). HTTP JSON, HTTP binary (Inference-Header-Content-Length) and gRPC ModelInfer (the protobuf
--   message, parsed here) alike. Triton 2.51 sizes buffers from a declared shape before it checks it against
--   the model: ~90-byte requests declaring huge or wrapping dims abort it (std::bad_alloc, std::length_error);
--   no such shape is a model's.
-- compression: a compressed body (Content-Encoding, or a gRPC message with its compressed flag) is refused
--   (415, gRPC UNIMPLEMENTED): what is checked must be what Triton reads; send it uncompressed. Every gRPC method,
--   not only ModelInfer: a 760 KiB gzip ModelConfig request inflated to a 768 MiB name cost Triton 5 GB.
-- body-limit: a gRPC request is one message of at most PROXY_MAX_BODY bytes (ModelInfer) or GRPC_SMALL_MAX bytes
--   (every other method: a model's name and version, parameters), whole in the buffer (413, RESOURCE_EXHAUSTED).
-- model: a model name longer than a file name (255 bytes) or a version that is no int64 names no model: refused
--   before the guard asks Triton about it (400); the guard's cache of models holds MAX_CACHED of them at most.
-- shared-memory: an input or output naming a shared-memory region is refused (the shared-memory API is not
--   served through the proxy, so no client of it can have registered one).
-- Refusals are JSON {"error": "proxy rule <name>: <why>"}, the shape Triton's own errors have, so that
-- tritonclient shows the reason; gRPC ones are trailers-only answers with grpc-status and grpc-message.

local MAX_DEPTH = 64
local MAX_BODY  -- PROXY_MAX_BODY, set below

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

local NULL = setmetatable({}, {__name = "null"})
local LITERALS = {["true"] = true, ["false"] = false, null = NULL}

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
  if type(t) ~= "table" or getmetatable(t) ~= nil then return false end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n == #t
end

local function is_object(t)
  return type(t) == "table" and getmetatable(t) == nil and not (next(t) ~= nil and is_list(t))
end

-- Bytes per element of each datatype as a request names it (BYTES: variable, at least its 4-byte length).
local SIZE = {BOOL = 1, UINT8 = 1, INT8 = 1, UINT16 = 2, INT16 = 2, FP16 = 2, BF16 = 2, UINT32 = 4, INT32 = 4,
              FP32 = 4, UINT64 = 8, INT64 = 8, FP64 = 8, BYTES = 4}
-- More elements than any body the proxy lets through could carry (8 MiB by default; 1 byte each at least).
local MAX_ELEMENTS = 1 << 40

local function clip(text)
  return (tostring(text):sub(1, 64):gsub("[^%w%._%-/ ]", "?"))
end

-- ---------------------------------------------------------------------------------------------------------------
-- What each served model declares, from Triton's own /config (its private port, TRITON_HTTP).

local TRITON_HTTP = os.getenv("TRITON_HTTP")
local CONFIG_TTL_MS = 2000
local MISSING = {}      -- a model Triton says it does not serve
local models = {}       -- "name/version" -> {spec = ..., at = ms}
local cached = 0        -- entries in `models`: past MAX_CACHED it starts again empty
local MAX_CACHED = 1024

local function now_ms()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
end

local function urlencode(text)
  return (text:gsub("[^%w%._%-]", function(c) return string.format("%%%02X", c:byte()) end))
end

-- A model's configuration (Triton's JSON) as the checks need it.
local function spec_of(config)
  local max_batch = config.max_batch_size
  max_batch = getmetatable(max_batch) == NUMBER and max_batch.integer and math.tointeger(max_batch.value) or 0
  local spec = {max_batch = max_batch, inputs = {}}
  for _, input in ipairs(is_list(config.input) and config.input or {}) do
    local dtype = type(input.data_type) == "string" and input.data_type:gsub("^TYPE_", "") or "?"
    if dtype == "STRING" then dtype = "BYTES" end
    local dims = {}
    for i, dim in ipairs(is_list(input.dims) and input.dims or {}) do
      dims[i] = getmetatable(dim) == NUMBER and math.tointeger(dim.value) or 0
    end
    spec.inputs[input.name] = {dtype = dtype, dims = dims, optional = input.optional == true}
  end
  return spec
end

-- The served model's spec; MISSING where Triton says there is none; nil where Triton does not answer.
local function fetch(name, version)
  local url = "http://" .. TRITON_HTTP .. "/v2/models/" .. urlencode(name)
  if version ~= "" then url = url .. "/versions/" .. urlencode(version) end
  local ok, reply = pcall(function() return core.httpclient():get{url = url .. "/config", timeout = 2000} end)
  if not ok or type(reply) ~= "table" or not reply.status or reply.status == 0 or reply.status >= 500 then
    return nil
  end
  if reply.status ~= 200 then return MISSING end
  local parsed, config = pcall(parse_json, reply.body or "")
  if not parsed or not is_object(config) then return nil end
  return spec_of(config)
end

-- How long a request waits for Triton to answer about a model it has never seen, while Triton restarts.
local CONFIG_WAIT_MS = 1000 * (tonumber(os.getenv("PROXY_RETRIES") or "") or 15)

local function model_spec(name, version, fresh)
  local key = name .. "/" .. version
  local entry, now = models[key], now_ms()
  if entry and not fresh and now - entry.at < CONFIG_TTL_MS then return entry.spec end
  if entry and fresh and now - entry.at < 100 then return entry.spec end
  local deadline = now + CONFIG_WAIT_MS
  while true do
    local spec = fetch(name, version)
    if spec then
      if models[key] == nil then
        cached = cached + 1
        if cached > MAX_CACHED then models, cached = {}, 1 end  -- many names asked for: none kept for good
      end
      models[key] = {spec = spec, at = now_ms()}
      return spec
    end
    if entry then return entry.spec end  -- Triton is down: what it declared last (it restarts with the same)
    if now_ms() >= deadline then return nil end
    core.msleep(250)
  end
end

-- ---------------------------------------------------------------------------------------------------------------
-- The check itself, one list of tensors for every protocol: {name, datatype, shape = {integers} or a reason,
-- values = how many JSON values, or bytes = the byte size the request carries for it}.

local function tensor_problem(spec, model, tensors)
  local seen = {}
  for _, t in ipairs(tensors) do
    local name = clip(t.name)
    local declared = type(t.name) == "string" and spec.inputs[t.name]
    if not declared then return "inputs", string.format("model %s has no input '%s'", clip(model), name) end
    if seen[t.name] then return "inputs", string.format("input '%s' is given twice", name) end
    seen[t.name] = true
    if t.datatype ~= declared.dtype then
      return "datatype", string.format("input '%s' is %s, not %s", name, declared.dtype, clip(t.datatype))
    end
    if type(t.shape) ~= "table" then return "shape", string.format("input '%s': %s", name, t.shape) end
    local batched = spec.max_batch > 0 and 1 or 0
    if #t.shape ~= #declared.dims + batched then
      return "shape", string.format("input '%s' has %d dims, the model %d", name, #t.shape, #declared.dims + batched)
    end
    local elements = 1
    for i, dim in ipairs(t.shape) do
      local want = declared.dims[i - batched]
      if dim < 0 then
        return "shape", string.format("input '%s': dim %d is negative", name, i)
      elseif batched == 1 and i == 1 then
        if dim > spec.max_batch then
          return "shape", string.format("input '%s': a batch of %d, over the model's max_batch_size %d", name, dim,
                                        spec.max_batch)
        end
      elseif want ~= -1 and dim ~= want then
        return "shape", string.format("input '%s': dim %d is %d, the model's is %d", name, i, dim, want)
      elseif dim > MAX_ELEMENTS then
        return "shape", string.format("input '%s': dim %d is %d", name, i, dim)
      end
      elements = elements * dim
      if elements > MAX_ELEMENTS then return "shape", string.format("input '%s' declares too many elements", name) end
    end
    if t.values then
      if t.values ~= elements then
        return "data-size", string.format("input '%s' has %d values for %d elements", name, t.values, elements)
      end
    elseif t.datatype == "BYTES" then
      if t.bytes < SIZE.BYTES * elements then
        return "data-size", string.format("input '%s' has %d bytes for %d strings", name, t.bytes, elements)
      end
    elseif t.bytes ~= SIZE[t.datatype] * elements then
      return "data-size", string.format("input '%s' has %d bytes, its shape needs %d", name, t.bytes,
                                        SIZE[t.datatype] * elements)
    end
  end
  for input_name, declared in pairs(spec.inputs) do
    if not declared.optional and not seen[input_name] then
      return "inputs", string.format("the request lacks input '%s'", clip(input_name))
    end
  end
end

-- Admit `tensors` for `model` (version "" = the default) or say why not (status, rule, why).
local function admit(model, version, tensors)
  if #model == 0 or #model > 255 then
    return 400, "model", string.format("a model name of %d bytes names no model (a folder's name: 1 to 255)", #model)
  end
  if #version > 19 or not version:match("^%d*$") then
    return 400, "model", "version '" .. clip(version) .. "' is not a version number (an int64)"
  end
  local spec = model_spec(model, version, false)
  if spec == nil then return 503, "model", "Triton does not answer about model " .. clip(model) end
  local rule, why
  if spec ~= MISSING then rule, why = tensor_problem(spec, model, tensors) end
  if spec == MISSING or rule then  -- against a copy older than a moment: read the model's config again
    spec = model_spec(model, version, true)
    if spec == MISSING then return 404, "model", "no model " .. clip(model) .. " is served" end
    if spec == nil then return 503, "model", "Triton does not answer about model " .. clip(model) end
    rule, why = tensor_problem(spec, model, tensors)
  end
  if rule then return 400, rule, why end
end

-- ---------------------------------------------------------------------------------------------------------------
-- HTTP/REST (KServe v2): the JSON header, and the binary part it describes.

local function integer_of(v)
  if getmetatable(v) ~= NUMBER or not v.integer or v.value ~= v.value then return nil end
  if v.value >= 2 ^ 53 or v.value <= -(2 ^ 53) then return nil end
  return math.tointeger(v.value)
end

local LEAF = {BOOL = "boolean", BYTES = "string"}

-- How many values `data` holds (nested lists flattened, as Triton reads them), or nil and why.
local function count_values(data, datatype)
  local kind = LEAF[datatype] or "number"
  local n = 0
  local function walk(v, depth)
    if is_list(v) then
      for _, x in ipairs(v) do
        if not walk(x, depth + 1) then return false end
      end
      return true
    end
    local actual = getmetatable(v) == NUMBER and "number" or type(v)
    if actual ~= kind then return false end
    n = n + 1
    return true
  end
  if not walk(data, 0) then return nil end
  return n
end

local function has_shared_memory(parameters)
  if parameters == nil then return false end
  if not is_object(parameters) then return true end
  for key in pairs(parameters) do
    if key:find("^shared_memory") then return true end
  end
  return false
end

-- The request's tensors, and the binary bytes they claim, from its JSON; or nil and why.
local function http_tensors(request)
  if not is_object(request) then return nil, "the request is not a JSON object" end
  if not is_list(request.inputs) or #request.inputs == 0 then return nil, "'inputs' is not a list of inputs" end
  for _, output in ipairs(is_list(request.outputs) and request.outputs or {}) do
    if is_object(output) and has_shared_memory(output.parameters) then return nil, "shared-memory" end
  end
  local tensors, binary = {}, 0
  for _, input in ipairs(request.inputs) do
    if not is_object(input) then return nil, "an input is not an object" end
    if type(input.name) ~= "string" or type(input.datatype) ~= "string" then
      return nil, "an input lacks its 'name' or 'datatype'"
    end
    if has_shared_memory(input.parameters) then return nil, "shared-memory" end
    local t = {name = input.name, datatype = input.datatype, shape = {}}
    if not is_list(input.shape) then
      t.shape = "'shape' is not a list"
    else
      for i, dim in ipairs(input.shape) do
        t.shape[i] = integer_of(dim)
        if t.shape[i] == nil then t.shape = "a dim is not an integer"; break end
      end
    end
    local size = input.parameters and input.parameters.binary_data_size
    if size ~= nil then
      size = integer_of(size)
      if not size or size < 0 or input.data ~= nil then
        return nil, string.format("input '%s': binary_data_size is not a length, or 'data' is also given",
                                  clip(input.name))
      end
      t.bytes, binary = size, binary + size
    else
      if input.data == nil then return nil, string.format("input '%s' has no 'data'", clip(input.name)) end
      t.values = count_values(input.data, input.datatype)
      if not t.values then
        return nil, string.format("input '%s': 'data' holds something other than %s values", clip(input.name),
                                  clip(input.datatype))
      end
    end
    tensors[#tensors + 1] = t
  end
  return tensors, binary
end

local function http_problem(txn, length)
  local path = txn.f:path()
  local model, version = path:match("^/v2/models/([^/]+)/versions/([0-9]+)/infer$")
  if not model then model, version = path:match("^/v2/models/([^/]+)/infer$"), "" end
  -- The body's first bytes (haproxy.cfg sets txn.inspect): the JSON part of a binary request is a few hundred
  -- bytes at its start, and copying a whole 600 KB tensor into Lua for it would cost every request.
  local body = txn:get_var("txn.inspect") or ""
  local json_length = length
  local binary = txn.http:req_get_headers()["inference-header-content-length"]
  if binary then
    json_length = tonumber(binary[0])
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
  local tensors, claimed = http_tensors(request)
  if not tensors then
    if claimed == "shared-memory" then
      return 400, "shared-memory", "shared-memory regions are not served through the proxy"
    end
    return 400, "inputs", claimed
  end
  if claimed ~= length - json_length then
    return 400, "data-size", string.format("the inputs claim %d binary bytes, the body has %d after its JSON",
                                           claimed, length - json_length)
  end
  return admit(model, version, tensors)
end

-- ---------------------------------------------------------------------------------------------------------------
-- gRPC ModelInfer: one length-prefixed protobuf message (inference.ModelInferRequest), parsed as far as needed.

local function need(s, stop)
  if stop > #s then error({grpc = "the message's inputs lie beyond what the proxy inspects: send one input, "
                                  .. "or smaller ones"}, 0) end
end

local function varint(s, i, limit)
  local value, shift = 0, 0
  while true do
    if i > limit then error({grpc = "a varint runs past its field"}, 0) end
    if i > #s then need(s, i) end
    local b = s:byte(i)
    i = i + 1
    value = value | ((b & 0x7F) << shift)
    if b < 0x80 then return value, i end
    shift = shift + 7
    if shift > 63 then error({grpc = "a varint longer than 10 bytes"}, 0) end
  end
end

-- Each field of the message in s[i..j]: field number, wire type, and its value (varint), or where its bytes
-- start and end (length-delimited; `stop` may lie beyond #s where the body was not all inspected).
local function fields(s, i, j)
  return function()
    if i > j then return nil end
    local key
    key, i = varint(s, i, j)
    local field, wire = key >> 3, key & 7
    if wire == 0 then
      local value
      value, i = varint(s, i, j)
      return field, wire, value
    elseif wire == 2 then
      local length
      length, i = varint(s, i, j)
      if length < 0 or length > j - i + 1 then error({grpc = "a field runs past its message"}, 0) end
      local start = i
      i = i + length
      return field, wire, start, i - 1
    elseif wire == 1 or wire == 5 then
      local start = i
      i = i + (wire == 1 and 8 or 4)
      if i - 1 > j then error({grpc = "a field runs past its message"}, 0) end
      return field, wire, start, i - 1
    end
    error({grpc = "wire type " .. wire .. " (groups) in the message"}, 0)
  end
end

local function parameters_name_shared_memory(s, i, j)  -- one map entry: key = field 1
  for field, wire, a, b in fields(s, i, j) do
    if field == 1 and wire == 2 and s:sub(a, b):find("^shared_memory") then return true end
  end
  return false
end

-- InferTensorContents: how many values, in which typed field (each datatype has one).
local CONTENTS = {BOOL = 1, INT8 = 2, INT16 = 2, INT32 = 2, INT64 = 3, UINT8 = 4, UINT16 = 4, UINT32 = 4, UINT64 = 5,
                  FP32 = 6, FP64 = 7, BYTES = 8}
local function count_contents(s, i, j, datatype)
  local n, wanted = 0, CONTENTS[datatype]
  for field, wire, a, b in fields(s, i, j) do
    if field ~= wanted then return nil end
    if field == 8 or wire == 0 or wire == 1 or wire == 5 then
      n = n + 1                                    -- one value (bytes, or not packed)
    elseif field == 6 then n = n + (b - a + 1) // 4  -- packed fixed32
    elseif field == 7 then n = n + (b - a + 1) // 8  -- packed fixed64
    else                                           -- packed varints: one per byte below 0x80
      for k = a, b do
        if s:byte(k) < 0x80 then n = n + 1 end
      end
    end
  end
  return n
end

local function grpc_tensor(s, i, j)
  local t, has_contents = {name = "", datatype = "", shape = {}}, false
  for field, wire, a, b in fields(s, i, j) do
    if field == 1 and wire == 2 then t.name = s:sub(a, b)
    elseif field == 2 and wire == 2 then t.datatype = s:sub(a, b)
    elseif field == 3 and wire == 0 then t.shape[#t.shape + 1] = a
    elseif field == 3 and wire == 2 then
      local k = a
      while k <= b do
        t.shape[#t.shape + 1], k = varint(s, k, b)
      end
    elseif field == 4 and wire == 2 then
      if parameters_name_shared_memory(s, a, b) then t.shared = true end
    elseif field == 5 and wire == 2 then
      has_contents = true
      t.values = count_contents(s, a, b, t.datatype)
      if not t.values then t.values = -1 end
    end
  end
  return t, has_contents
end

-- One gRPC message (its 5-byte header, then as much of it as the buffer holds): nothing where it may pass, else
-- (status, rule, why). `judge(model, version, tensors)` admits the tensors or says why not.
local function grpc_check(body, judge)
  if #body < 5 then return 400, "grpc-message", "the request does not start with a gRPC message header" end
  local compressed, length = string.unpack(">BI4", body)
  if compressed ~= 0 then
    return 415, "compression", "a compressed gRPC message: send it uncompressed (the proxy checks what Triton reads)"
  end
  if MAX_BODY and length > MAX_BODY then
    return 413, "body-limit", string.format("a gRPC message of %d bytes, over %d", length, MAX_BODY)
  end
  local j = 5 + length                         -- the message is body[6..j]; the buffer may hold less of it
  local model, version, tensors, raw, contents = "", "", {}, {}, 0
  local ok, failure = pcall(function()
    for field, wire, a, b in fields(body, 6, j) do
      if wire ~= 0 and field ~= 7 then need(body, b) end
      if field == 1 and wire == 2 then model = body:sub(a, b)
      elseif field == 2 and wire == 2 then version = body:sub(a, b)
      elseif field == 5 and wire == 2 then
        local t, has_contents = grpc_tensor(body, a, b)
        if has_contents then contents = contents + 1 end
        tensors[#tensors + 1] = t
      elseif field == 6 and wire == 2 then
        for f, w, c, d in fields(body, a, b) do
          if f == 2 and w == 2 and parameters_name_shared_memory(body, c, d) then tensors.shared = true end
        end
      elseif field == 7 and wire == 2 then raw[#raw + 1] = b - a + 1
      end
      -- a raw content's bytes need not be in the buffer, but the field after it must be
      if field == 7 and b < j then need(body, b + 1) end
    end
  end)
  if not ok then
    return 400, "grpc-message", type(failure) == "table" and failure.grpc or tostring(failure):sub(1, 200)
  end
  if #tensors == 0 then return 400, "inputs", "the request has no inputs" end
  for _, t in ipairs(tensors) do
    if t.shared then return 400, "shared-memory", "shared-memory regions are not served through the proxy" end
  end
  if tensors.shared then return 400, "shared-memory", "shared-memory regions are not served through the proxy" end
  if #raw > 0 then
    if contents > 0 or #raw ~= #tensors then
      return 400, "data-size", string.format("%d raw_input_contents for %d inputs (%d with contents)", #raw,
                                             #tensors, contents)
    end
    for k, t in ipairs(tensors) do t.bytes, t.values = raw[k], nil end
  else
    for _, t in ipairs(tensors) do
      if not t.values then return 400, "data-size", "input '" .. clip(t.name) .. "' carries no data" end
      if t.values < 0 then
        return 400, "data-size", "input '" .. clip(t.name) .. "' carries contents of another datatype"
      end
    end
  end
  return judge(model, version, tensors)
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

local GRPC_SERVICE = "/inference.GRPCInferenceService/"
local GRPC_INFER = GRPC_SERVICE .. "ModelInfer"
-- HTTP statuses as gRPC status codes (UNAUTHENTICATED, NOT_FOUND, RESOURCE_EXHAUSTED, INVALID_ARGUMENT,
-- FAILED_PRECONDITION, UNIMPLEMENTED, UNAVAILABLE).
local GRPC_STATUS = {[401] = "16", [404] = "5", [413] = "8", [400] = "3", [411] = "9", [415] = "12", [503] = "14"}

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

MAX_BODY = tonumber(os.getenv("PROXY_MAX_BODY") or "")

local function grpc_problem(txn)
  return grpc_check(txn.f:req_body() or "", admit)
end

-- Every gRPC method but ModelInfer (whose message grpc_check reads): one uncompressed message, small, whole.
local GRPC_SMALL_MAX = 16384
local function grpc_small_problem(txn)
  local body = txn.f:req_body() or ""
  if #body < 5 then return 400, "grpc-message", "the request does not start with a gRPC message header" end
  local compressed, length = string.unpack(">BI4", body)
  if compressed ~= 0 then
    return 415, "compression", "a compressed gRPC message: send it uncompressed (the proxy checks what Triton reads)"
  end
  if length > GRPC_SMALL_MAX then
    return 413, "body-limit", string.format("a gRPC message of %d bytes, over %d for this method", length,
                                            GRPC_SMALL_MAX)
  end
  if #body ~= 5 + length then
    return 400, "grpc-message", string.format("a unary call carries one message of %d bytes, not %d bytes", length,
                                              #body - 5)
  end
end

-- A request that was in flight at two deaths of Triton (haproxy.cfg's hold_* keep their fingerprints).
local function quarantined(txn)
  local fp, killers = txn:get_var("txn.fp"), txn:get_var("proc.killers")
  if fp == nil or killers == nil then return nil end
  if not (killers .. " "):find(" " .. tostring(fp) .. " ", 1, true) then return nil end
  return 400, "quarantine", "this request was in flight each time Triton died, twice: it is not sent to Triton again"
end

-- Nothing where the request may pass, else (HTTP status, rule, why).
-- What a probe and a Prometheus scrape read, without a token: Kubernetes' httpGet probes send no secret header.
local OPEN = {["/v2/health/ready"] = true, ["/v2/health/live"] = true, ["/metrics"] = true}

local function check(txn)
  if EXPECTED and not (txn.f:method() == "GET" and OPEN[txn.f:path()]) and header(txn, "authorization") ~= EXPECTED then
    return 401, "token", "missing or wrong 'authorization: Bearer' token"
  end
  local encoding = header(txn, "content-encoding")
  if encoding and encoding:lower() ~= "identity" then
    return 415, "compression", "a body with Content-Encoding " .. clip(encoding) .. ": send it uncompressed "
                               .. "(the proxy checks what Triton reads)"
  end
  local status, rule, why = quarantined(txn)
  if status then return status, rule, why end
  if txn.f:path() == GRPC_INFER then return grpc_problem(txn) end
  if txn.f:path():find(GRPC_SERVICE, 1, true) == 1 then return grpc_small_problem(txn) end
  if txn.f:method() ~= "POST" or not txn.f:path():match("/infer$") then return end  -- gRPC: .../ModelInfer
  local length = tonumber(header(txn, "content-length") or "")
  if not length then
    return 411, "content-length", "an inference request must say its Content-Length"
  end
  return http_problem(txn, length)
end

-- Overload: the queue before Triton (`backend`'s, its server capped at `in_flight` requests) may hold what Triton
-- answers in `queue_ms` at the rate it answered in the last second (`answered`, a table counting answers), and
-- `in_flight` at least, plus what the holding layer still holds; beyond, refused at once.
core.register_action("overload", {"http-req"}, function(txn, backend, answered, queue_ms, in_flight)
  local queued = txn.f:queue(backend) or 0
  if queued == 0 then return end
  local rate = txn.c:table_gpc0_rate(0, answered) or 0
  -- Requests held while Triton restarted (the holding layer, `backend`'s backup server) reach it first when it
  -- is back: they are no overload, and the requests behind them wait for them too.
  local held = txn.f:srv_conn(backend .. "/hold") or 0
  local room = math.max(tonumber(in_flight), rate * tonumber(queue_ms) // 1000) + held
  if queued >= room then
    refuse(txn, 503, "overload", string.format("Triton is at capacity and %d requests wait already; try again",
                                               queued))
  end
end, 4)

-- The holding layer's own check: a replay of a quarantined request goes no further.
core.register_action("hold", {"http-req"}, function(txn)
  local status, rule, why = quarantined(txn)
  if status then refuse(txn, status, rule, why) end
end, 0)

core.register_action("guard", {"http-req"}, function(txn)
  local ok, status, rule, why = pcall(check, txn)
  if not ok then  -- fail closed: a request the guard could not judge does not reach Triton
    status, rule, why = 400, "guard", "the proxy could not check this request: " .. tostring(status):sub(1, 200)
  end
  if status then refuse(txn, status, rule, why) end
end, 0)
