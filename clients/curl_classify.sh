#!/usr/bin/env bash
# TorchServe's `curl .../predictions/resnet-152 -T kitten.jpg`, on Triton: plain HTTP, no client library.
# Usage: clients/curl_classify.sh IMAGE [HOST:PORT] [MODEL] [TOP_K]
# The file's bytes travel as one BYTES element in Triton's binary data extension (4-byte little-endian
# length, then the bytes) after a JSON header; LOGITS comes back through the classification extension
# as "score:index:label" strings.
set -euo pipefail
image=${1:?usage: $0 IMAGE [HOST:PORT] [MODEL] [TOP_K]}
url=${2:-127.0.0.1:8000}
model=${3:-resnet152}
k=${4:-5}
size=$(stat -c %s "$image")
header='{"inputs":[{"name":"IMAGE_BYTES","shape":[1,1],"datatype":"BYTES","parameters":{"binary_data_size":'$((size + 4))'}}],"outputs":[{"name":"LOGITS","parameters":{"classification":'$k',"binary_data":false}}]}'
le32() { printf "\\x$(printf %02x $(($1 & 255)))\\x$(printf %02x $(($1 >> 8 & 255)))\\x$(printf %02x $(($1 >> 16 & 255)))\\x$(printf %02x $(($1 >> 24 & 255)))"; }
{ printf '%s' "$header"; le32 "$size"; cat "$image"; } |
  curl -sS --fail-with-body -H "Inference-Header-Content-Length: ${#header}" \
       -H "Content-Type: application/octet-stream" --data-binary @- "http://$url/v2/models/${model}_image/infer"
echo
